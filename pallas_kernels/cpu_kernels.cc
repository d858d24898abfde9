// Native CPU kernels: XLA FFI custom calls (pallas_kernels/cpu_native.py).
//
// MedhaCpuDecodeAttention: paged decode attention. One query per sequence (a decode) over that sequence's pages of a paged KV cache:
//   out[s, h] = softmax(sm_scale * q[s, h] . K[s, start_s : kv_len_s, h / q_per_kv]) V[...]
//   lse[s, h] = log of that softmax's normaliser (natural log, scaled scores)
// exactly what pallas_kernels.xla_attention.decode_attention_xla computes, read in place:
// the XLA path spends most of a small decode step in its loops' per-op costs (a lone
// SmolLM2 decode: ~23 ms of attention for ~18 MB of K/V), which this loop does not have.
//
// Shapes (f32; the caller folds K/V heads into the last axis, a free reshape):
//   q          [seqs, q_heads, head_dim]
//   k, v       [num_pages, page_size, kv_heads * head_dim]
//   page_table int32 [seqs, pages_per_seq]
//   kv_lens    int32 [seqs]     keys 0 .. kv_len - 1 (0: no keys: out 0, lse -inf)
//   starts     int32 [seqs]     the first key each query sees (a sliding window; else 0)
// Results: out [seqs, q_heads, head_dim], lse [seqs, q_heads].
//
// MedhaCpuLayerMatmul: y = x @ w[layer] for a few rows (a decode step's tokens), reading
// one layer's matrix in place out of the weights stacked over layers:
//   x [rows, k], w [layers, k, n], layer int32 [] -> y [rows, n]
// Inside XLA's layer scan every layer's weights are first sliced out of the stack: XLA:CPU
// copies the slice (or, at one row, folds the product into a slice loop on one thread), so
// a small decode step moved each weight two or three times for one use (a lone SmolLM2
// decode: ~45 of a ~50 ms step).
//
// MedhaCpuMatmulT: y = x @ w.T for a few rows, w [n, k]: the LM head tied to the embedding
// [vocab, hidden], whose transpose XLA's dot reads at a third of the memory's speed at 2-8
// rows (SmolLM2: 10-15 ms for 113 MB).
//
// Work is split into items (a (sequence, K/V head), or a block of columns) over XLA's
// intra-op thread pool; the calling thread takes items too and never waits for a helper
// that has not started one, so a pool busy with other ops cannot stall it.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Problem {
  const float* q;
  const float* k;
  const float* v;
  const int32_t* page_table;
  const int32_t* kv_lens;
  const int32_t* starts;
  float* out;
  float* lse;
  int64_t seqs, q_heads, kv_heads, head_dim, num_pages, page_size, pages_per_seq;
  float sm_scale;
};


float Dot(const float* __restrict__ a, const float* __restrict__ b, int64_t n) {
  // Eight independent partial sums: vectorised without reassociating one sum.
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) lanes[j] += a[i + j] * b[i + j];
  float sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
              ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// One sequence's query heads of one K/V head: an online softmax over its keys, a page at
// a time (one rescale of the accumulator per page, not per key).
void AttendItem(const Problem& p, int64_t item) {
  const int64_t s = item / p.kv_heads, g = item % p.kv_heads;
  const int64_t q_per_kv = p.q_heads / p.kv_heads, d = p.head_dim;
  const int64_t row_stride = p.kv_heads * d;         // floats per cached token
  const int64_t first_head = g * q_per_kv;
  float* out = p.out + (s * p.q_heads + first_head) * d;
  float* lse = p.lse + s * p.q_heads + first_head;
  const int64_t end = p.kv_lens[s];
  const int64_t begin = std::max<int64_t>(p.starts[s], 0);
  std::fill(out, out + q_per_kv * d, 0.0f);
  if (end <= begin) {
    std::fill(lse, lse + q_per_kv, kNegInf);
    return;
  }
  const float* q = p.q + (s * p.q_heads + first_head) * d;
  const int32_t* pages = p.page_table + s * p.pages_per_seq;
  float m[64], l[64], scores[64];                   // per query head of the group
  for (int64_t h = 0; h < q_per_kv; ++h) m[h] = kNegInf, l[h] = 0.0f;
  for (int64_t key = begin; key < end;) {
    const int64_t slot = key / p.page_size, row = key % p.page_size;
    const int64_t run = std::min(p.page_size - row, end - key);   // keys in this page
    const int64_t base = (int64_t(pages[slot]) * p.page_size + row) * row_stride + g * d;
    const float* k = p.k + base;
    const float* v = p.v + base;
    for (int64_t h = 0; h < q_per_kv; ++h) {
      const float* qh = q + h * d;
      float page_max = kNegInf;
      for (int64_t j = 0; j < run; ++j) {
        scores[j] = Dot(qh, k + j * row_stride, d) * p.sm_scale;
        page_max = std::max(page_max, scores[j]);
      }
      const float new_m = std::max(m[h], page_max);
      const float rescale = std::exp(m[h] - new_m);  // 0 on the first page (m = -inf)
      float* acc = out + h * d;
      float page_sum = 0.0f;
      for (int64_t i = 0; i < d; ++i) acc[i] *= rescale;
      for (int64_t j = 0; j < run; ++j) {
        const float w = std::exp(scores[j] - new_m);
        page_sum += w;
        const float* vj = v + j * row_stride;
        for (int64_t i = 0; i < d; ++i) acc[i] += w * vj[i];
      }
      l[h] = l[h] * rescale + page_sum;
      m[h] = new_m;
    }
    key += run;
  }
  for (int64_t h = 0; h < q_per_kv; ++h) {
    const float inv = 1.0f / l[h];
    for (int64_t i = 0; i < d; ++i) out[h * d + i] *= inv;
    lse[h] = m[h] + std::log(l[h]);
  }
}

// Items 0 .. num_items - 1 of `problem`, each run once by whichever thread claims it.
template <typename P, void (*Run)(const P&, int64_t)>
struct Shared {
  P problem;
  int64_t num_items = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void RunItems() {
    int64_t item;
    while ((item = next.fetch_add(1)) < num_items) {
      Run(problem, item);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Runs every item on the calling thread and up to `helpers` of the pool's.
template <typename P, void (*Run)(const P&, int64_t)>
void RunOnPool(ffi::ThreadPool& pool, const P& problem, int64_t num_items, int64_t helpers) {
  auto shared = std::make_shared<Shared<P, Run>>();
  shared->problem = problem;
  shared->num_items = num_items;
  helpers = std::min<int64_t>({helpers, std::max<int64_t>(1, pool.num_threads()) - 1,
                               num_items - 1});
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([shared] { shared->RunItems(); });
  shared->RunItems();
  while (shared->done.load(std::memory_order_acquire) < num_items) std::this_thread::yield();
}

ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                               ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                               ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> kv_lens,
                               ffi::Buffer<ffi::S32> starts, ffi::ResultBuffer<ffi::F32> out,
                               ffi::ResultBuffer<ffi::F32> lse, float sm_scale) {
  const auto qd = q.dimensions(), kd = k.dimensions(), td = page_table.dimensions();
  const auto vd = v.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || td.size() != 2 || vd.size() != 3 ||
      vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2])
    return ffi::Error::InvalidArgument(
        "want q [seqs, q_heads, head_dim], k and v [pages, page_size, kv_heads * head_dim], "
        "page_table [seqs, pages_per_seq]");
  Problem p;
  p.seqs = qd[0], p.q_heads = qd[1], p.head_dim = qd[2];
  p.num_pages = kd[0], p.page_size = kd[1], p.pages_per_seq = td[1];
  if (p.head_dim < 1 || kd[2] % p.head_dim) return ffi::Error::InvalidArgument("head_dim");
  p.kv_heads = kd[2] / p.head_dim;
  if (p.kv_heads < 1 || p.q_heads % p.kv_heads || p.q_heads / p.kv_heads > 64 ||
      td[0] != p.seqs || kv_lens.element_count() != p.seqs ||
      starts.element_count() != p.seqs || p.page_size > 64)
    return ffi::Error::InvalidArgument(
        "q_heads must be a multiple of kv_heads (at most 64 per K/V head), page_size at "
        "most 64, and page_table, kv_lens and starts one row per sequence");
  p.q = q.typed_data(), p.k = k.typed_data(), p.v = v.typed_data();
  p.page_table = page_table.typed_data(), p.kv_lens = kv_lens.typed_data();
  p.starts = starts.typed_data(), p.out = out->typed_data(), p.lse = lse->typed_data();
  p.sm_scale = sm_scale;
  // Every page a query will read must exist: a bad page id is an error, never a stray read.
  int64_t work = 0;
  for (int64_t s = 0; s < p.seqs; ++s) {
    const int64_t end = p.kv_lens[s], begin = std::max<int64_t>(p.starts[s], 0);
    if (end > p.pages_per_seq * p.page_size)
      return ffi::Error::InvalidArgument("kv_len past the page table's width");
    for (int64_t slot = begin / p.page_size; begin < end && slot <= (end - 1) / p.page_size;
         ++slot) {
      const int32_t page = p.page_table[s * p.pages_per_seq + slot];
      if (page < 0 || page >= p.num_pages)
        return ffi::Error::InvalidArgument("page id outside the cache");
    }
    work += std::max<int64_t>(end - begin, 0);
  }
  // Helpers only where the keys are worth a thread hand-off (a few microseconds).
  const int64_t helpers = work * p.q_heads >= 16384 ? p.seqs * p.kv_heads : 0;
  RunOnPool<Problem, AttendItem>(pool, p, p.seqs * p.kv_heads, helpers);
  return ffi::Error::Success();
}

// ------------------------------------------------------------------------ layer matmul

struct Matmul {
  const float* x;      // [rows, k]
  const float* w;      // [k, n]: the layer's matrix
  float* y;            // [rows, n]
  int64_t rows, k, n;
};

constexpr int64_t kBlockColumns = 32;    // four 8-float vectors per row in registers

// y[r0 : r0 + R, c0 : c0 + 32] for R <= 4 rows: the accumulators stay in registers while
// the loop walks down the 32 columns of every row of w (each cache line read once).
template <int R>
void MatmulBlock(const Matmul& m, int64_t r0, int64_t c0) {
  float acc[R][kBlockColumns] = {};
  const float* x = m.x + r0 * m.k;
  for (int64_t d = 0; d < m.k; ++d) {
    const float* __restrict__ row = m.w + d * m.n + c0;
    for (int r = 0; r < R; ++r) {
      const float a = x[r * m.k + d];
      for (int j = 0; j < kBlockColumns; ++j) acc[r][j] += a * row[j];
    }
  }
  for (int r = 0; r < R; ++r)
    std::copy(acc[r], acc[r] + kBlockColumns, m.y + (r0 + r) * m.n + c0);
}

// Item: one block of 32 columns, every row (in groups of up to four).
void MatmulItem(const Matmul& m, int64_t item) {
  const int64_t c0 = item * kBlockColumns;
  for (int64_t r0 = 0; r0 < m.rows; r0 += 4) {
    switch (std::min<int64_t>(4, m.rows - r0)) {
      case 1: MatmulBlock<1>(m, r0, c0); break;
      case 2: MatmulBlock<2>(m, r0, c0); break;
      case 3: MatmulBlock<3>(m, r0, c0); break;
      default: MatmulBlock<4>(m, r0, c0); break;
    }
  }
}

// ------------------------------------------------------------------- transposed matmul

// y = x @ w.T for a few rows, w [n, k] row-major (an LM head tied to the embedding).
struct MatmulT {
  const float* x;      // [rows, k]
  const float* w;      // [n, k]
  float* y;            // [rows, n]
  int64_t rows, k, n;
};

constexpr int64_t kBlockOutputs = 64;   // rows of w per item

// Item: outputs [item * 64, item * 64 + 64) of every row: each row of w read once (it stays
// in L1 while up to four x rows take their dot products with it).
void MatmulTItem(const MatmulT& m, int64_t item) {
  const int64_t v0 = item * kBlockOutputs, v1 = std::min(m.n, v0 + kBlockOutputs);
  for (int64_t v = v0; v < v1; ++v) {
    const float* __restrict__ row = m.w + v * m.k;
    for (int64_t r = 0; r < m.rows; ++r) m.y[r * m.n + v] = Dot(m.x + r * m.k, row, m.k);
  }
}

ffi::Error MatmulTImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                       ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || wd[1] != xd[1])
    return ffi::Error::InvalidArgument("want x [rows, k], w [n, k]");
  MatmulT m;
  m.rows = xd[0], m.k = xd[1], m.n = wd[0];
  m.x = x.typed_data(), m.w = w.typed_data(), m.y = y->typed_data();
  const int64_t blocks = (m.n + kBlockOutputs - 1) / kBlockOutputs;
  RunOnPool<MatmulT, MatmulTItem>(pool, m, blocks, blocks);
  return ffi::Error::Success();
}

ffi::Error LayerMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                           ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> layer,
                           ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[1] != xd[1] || layer.element_count() != 1)
    return ffi::Error::InvalidArgument("want x [rows, k], w [layers, k, n], layer int32 []");
  if (wd[2] % kBlockColumns)
    return ffi::Error::InvalidArgument("n must be a multiple of 32");
  const int32_t l = *layer.typed_data();
  if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("layer outside the stack");
  Matmul m;
  m.rows = xd[0], m.k = xd[1], m.n = wd[2];
  m.x = x.typed_data(), m.w = w.typed_data() + int64_t(l) * m.k * m.n, m.y = y->typed_data();
  const int64_t blocks = m.n / kBlockColumns;
  RunOnPool<Matmul, MatmulItem>(pool, m, blocks, blocks);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MedhaCpuDecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v
                                  .Arg<ffi::Buffer<ffi::S32>>()   // page_table
                                  .Arg<ffi::Buffer<ffi::S32>>()   // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()   // starts
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out
                                  .Ret<ffi::Buffer<ffi::F32>>()   // lse
                                  .Attr<float>("sm_scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MedhaCpuLayerMatmul, LayerMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w, stacked
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y

XLA_FFI_DEFINE_HANDLER_SYMBOL(MedhaCpuMatmulT, MatmulTImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w [n, k]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y
