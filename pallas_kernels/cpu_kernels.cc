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
// MedhaCpuChunkAttention: the same for the prefill chunks of a ragged batch (sequences of
// 2 or more queries; decodes and padding rows are 0 / -inf), query t seeing keys
// starts[t] .. ends[t] - 1 of its sequence:
//   q [tokens, q_heads, head_dim], k, v as above, page_table int32 [max_seqs, pages_per_seq],
//   cu_q_lens int32 [max_seqs + 1], num_seqs int32 [1], starts, ends int32 [tokens]
// exactly what xla_attention._query_blocks_xla computes: on a CPU, XLA runs its block and
// tile loops at ~20-50 GFLOP/s (SmolLM2, a 256-token chunk at 1K context: ~15 ms a layer).
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
// Work is split into items (a (sequence, K/V head), a block of a chunk's queries of one K/V
// head, a share of a matrix's rows or a block of its columns) over XLA's
// intra-op thread pool; the calling thread takes items too and never waits for a helper
// that has not started one, so a pool busy with other ops cannot stall it.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Eight floats: GCC/Clang vector extensions, so the loops below say what they compute and
// compile to AVX (or SSE pairs) on whatever -march=native finds.
typedef float F8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t I8 __attribute__((vector_size(32), aligned(4)));

inline F8 Splat(float x) { return F8{x, x, x, x, x, x, x, x}; }
inline F8 Load(const float* p) { return *reinterpret_cast<const F8*>(p); }
inline void Store(float* p, F8 x) { *reinterpret_cast<F8*>(p) = x; }

// e^x, eight at a time (Cephes' expf: range reduction by ln 2, a degree-6 polynomial; within
// 2 ulp of std::exp on [-87, 88]), 0 below -87 (x = -inf included): the softmax's weights.
inline F8 Exp(F8 x) {
  const I8 underflow = x < Splat(-87.0f);
  x = x > Splat(88.0f) ? Splat(88.0f) : x;
  x = x < Splat(-87.0f) ? Splat(-87.0f) : x;
  const F8 magic = Splat(12582912.0f);                 // 1.5 * 2^23: round to nearest
  const F8 n = (x * Splat(1.44269504088896341f) + magic) - magic;
  F8 g = x - n * Splat(0.693359375f);
  g = g - n * Splat(-2.12194440e-4f);
  F8 y = Splat(1.9875691500e-4f);
  y = y * g + Splat(1.3981999507e-3f);
  y = y * g + Splat(8.3334519073e-3f);
  y = y * g + Splat(4.1665795894e-2f);
  y = y * g + Splat(1.6666665459e-1f);
  y = y * g + Splat(5.0000001201e-1f);
  y = y * g * g + g + Splat(1.0f);
  const I8 bits = (__builtin_convertvector(n, I8) + 127) << 23;   // 2^n
  F8 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  y *= scale;
  I8 y_bits;
  std::memcpy(&y_bits, &y, sizeof y_bits);
  y_bits &= ~underflow;
  std::memcpy(&y, &y_bits, sizeof y);
  return y;
}

inline float MaxOf(F8 x) {
  float m = x[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, x[i]);
  return m;
}

inline float SumOf(F8 x) {
  return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
}

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
    if (key + run < end) {
      // The next page lies anywhere in the cache, where no hardware prefetcher follows:
      // ask for its rows (this head's part) while this page's are computed.
      const int64_t next = (int64_t(pages[slot + 1]) * p.page_size) * row_stride + g * d;
      const int64_t next_run = std::min(p.page_size, end - key - run);
      for (int64_t j = 0; j < next_run; ++j)
        for (int64_t i = 0; i < d; i += 16) {
          __builtin_prefetch(p.k + next + j * row_stride + i);
          __builtin_prefetch(p.v + next + j * row_stride + i);
        }
    }
    for (int64_t h = 0; h < q_per_kv; ++h) {
      const float* qh = q + h * d;
      float page_max = kNegInf;
      for (int64_t j = 0; j < run; ++j) {
        scores[j] = Dot(qh, k + j * row_stride, d) * p.sm_scale;
        page_max = std::max(page_max, scores[j]);
      }
      for (int64_t j = run; j % 8; ++j) scores[j] = kNegInf;     // weight 0
      const float new_m = std::max(m[h], page_max);
      const float rescale = std::exp(m[h] - new_m);  // 0 on the first page (m = -inf)
      F8 sums = Splat(0);
      for (int64_t j = 0; j < run; j += 8) {         // the weights, eight at a time
        const F8 w = Exp(Load(scores + j) - Splat(new_m));
        Store(scores + j, w);
        sums += w;
      }
      float* acc = out + h * d;
      for (int64_t i = 0; i < d; ++i) acc[i] *= rescale;
      for (int64_t j = 0; j < run; ++j) {
        const float w = scores[j];
        const float* vj = v + j * row_stride;
        for (int64_t i = 0; i < d; ++i) acc[i] += w * vj[i];
      }
      l[h] = l[h] * rescale + SumOf(sums);
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
  // Helpers only where the keys are worth a thread hand-off (a few microseconds). A lone
  // SmolLM2 decode at ~400 keys (~3,600 key-heads a layer) took 3.3 ms of attention a step
  // on one thread, 2.4 ms with the pool's other thread.
  const int64_t helpers = work * p.q_heads >= 1024 ? p.seqs * p.kv_heads : 0;
  RunOnPool<Problem, AttendItem>(pool, p, p.seqs * p.kv_heads, helpers);
  return ffi::Error::Success();
}

// ------------------------------------------------------------------ chunk attention

struct Chunks {
  const float* q;          // [tokens, q_heads, head_dim]
  const float* k;          // [num_pages, page_size, kv_heads * head_dim]
  const float* v;
  const int32_t* page_table;
  const int32_t* starts;   // [tokens]: the first key each query sees
  const int32_t* ends;     // [tokens]: keys < end
  const int64_t* items;    // per item: sequence, K/V head, first token, tokens (4 each)
  float* out;
  float* lse;
  int64_t q_heads, kv_heads, head_dim, page_size, pages_per_seq;
  float sm_scale;
};

constexpr int64_t kChunkRows = 64;     // query rows (tokens x heads of a group) per item
constexpr int64_t kTileKeys = 64;      // keys per online-softmax step (whole pages or fewer)
constexpr int64_t kMaxHeadDim = 256;

struct ChunkScratch {
  alignas(32) float qs[kChunkRows + 3][kMaxHeadDim];     // the rows' queries, scaled
  alignas(32) float acc[kChunkRows + 1][kMaxHeadDim];    // their weighted values
  alignas(32) float keys_t[kMaxHeadDim][kTileKeys];      // a tile's keys, transposed
  alignas(32) float p[kChunkRows + 3][kTileKeys];        // scores, then weights
  const float* values[kTileKeys];                        // a tile's value rows
};

// Scores of rows r..r+3 against the tile's keys j..j+15: 8 vectors of accumulators.
inline void Scores4x16(ChunkScratch& w, int64_t d, int64_t r, int64_t j) {
  F8 s00 = Splat(0), s01 = Splat(0), s10 = Splat(0), s11 = Splat(0);
  F8 s20 = Splat(0), s21 = Splat(0), s30 = Splat(0), s31 = Splat(0);
  for (int64_t i = 0; i < d; ++i) {
    const F8 k0 = Load(&w.keys_t[i][j]), k1 = Load(&w.keys_t[i][j + 8]);
    const F8 q0 = Splat(w.qs[r][i]), q1 = Splat(w.qs[r + 1][i]);
    const F8 q2 = Splat(w.qs[r + 2][i]), q3 = Splat(w.qs[r + 3][i]);
    s00 += q0 * k0, s01 += q0 * k1, s10 += q1 * k0, s11 += q1 * k1;
    s20 += q2 * k0, s21 += q2 * k1, s30 += q3 * k0, s31 += q3 * k1;
  }
  Store(&w.p[r][j], s00), Store(&w.p[r][j + 8], s01);
  Store(&w.p[r + 1][j], s10), Store(&w.p[r + 1][j + 8], s11);
  Store(&w.p[r + 2][j], s20), Store(&w.p[r + 2][j + 8], s21);
  Store(&w.p[r + 3][j], s30), Store(&w.p[r + 3][j + 8], s31);
}

// acc[r], acc[r1] (dims i .. i + 8 * kLanes) += their weights times the tile's values.
template <int kLanes>
inline void AddValues(ChunkScratch& w, int64_t r, int64_t r1, int64_t i, int64_t run) {
  F8 a0[kLanes], a1[kLanes];
  for (int u = 0; u < kLanes; ++u)
    a0[u] = Load(&w.acc[r][i + 8 * u]), a1[u] = Load(&w.acc[r1][i + 8 * u]);
  for (int64_t j = 0; j < run; ++j) {
    const float* vj = w.values[j] + i;
    const F8 w0 = Splat(w.p[r][j]), w1 = Splat(w.p[r1][j]);
    for (int u = 0; u < kLanes; ++u) {
      const F8 x = Load(vj + 8 * u);
      a0[u] += w0 * x, a1[u] += w1 * x;
    }
  }
  for (int u = 0; u < kLanes; ++u)
    Store(&w.acc[r][i + 8 * u], a0[u]), Store(&w.acc[r1][i + 8 * u], a1[u]);
}

// One item: a block of a chunk's queries, every query head of one K/V head (the rows), over
// the sequence's keys, an online softmax a tile of up to 64 keys at a time. Each tile's keys
// are transposed once into [head_dim, keys] so the rows' scores come from broadcast
// multiply-adds across keys, 4 rows x 16 keys at a time; the values are added 2 rows x 32
// dims at a time.
void ChunkItem(const Chunks& c, int64_t item) {
  const int64_t* it = c.items + 4 * item;
  const int64_t s = it[0], g = it[1], t0 = it[2], nt = it[3];
  const int64_t q_per_kv = c.q_heads / c.kv_heads, d = c.head_dim;
  const int64_t rows = nt * q_per_kv, padded_rows = (rows + 3) / 4 * 4;
  const int64_t row_stride = c.kv_heads * d;
  thread_local std::unique_ptr<ChunkScratch> scratch;  // ~200 KB: not on a pool thread's stack
  if (!scratch) scratch = std::make_unique<ChunkScratch>();
  ChunkScratch& w = *scratch;
  float m[kChunkRows], l[kChunkRows];
  int64_t row_start[kChunkRows], row_end[kChunkRows];
  // Row r: token t0 + r / q_per_kv, query head g * q_per_kv + r % q_per_kv.
  int64_t first_key = std::numeric_limits<int64_t>::max(), last_key = 0;
  for (int64_t r = 0; r < padded_rows; ++r) {
    if (r >= rows) {
      std::fill(w.qs[r], w.qs[r] + d, 0.0f);
      continue;
    }
    const int64_t t = t0 + r / q_per_kv, h = g * q_per_kv + r % q_per_kv;
    const float* qr = c.q + (t * c.q_heads + h) * d;
    for (int64_t i = 0; i < d; ++i) w.qs[r][i] = qr[i] * c.sm_scale;
    std::fill(w.acc[r], w.acc[r] + d, 0.0f);
    m[r] = kNegInf, l[r] = 0.0f;
    row_start[r] = std::max<int32_t>(c.starts[t], 0), row_end[r] = c.ends[t];
    if (row_start[r] < row_end[r]) {
      first_key = std::min(first_key, row_start[r]);
      last_key = std::max(last_key, row_end[r]);
    }
  }
  const int32_t* pages = c.page_table + s * c.pages_per_seq;
  for (int64_t key = first_key; key < last_key; key += kTileKeys) {
    const int64_t run = std::min(kTileKeys, last_key - key);
    const int64_t width = (run + 15) / 16 * 16;       // keys, in whole 16s
    for (int64_t j = 0; j < run; ++j) {
      const int64_t pos = key + j;
      const int64_t at = (int64_t(pages[pos / c.page_size]) * c.page_size + pos % c.page_size) *
                         row_stride + g * d;
      w.values[j] = c.v + at;
      const float* kj = c.k + at;
      for (int64_t i = 0; i < d; ++i) w.keys_t[i][j] = kj[i];
    }
    // Keys run .. width - 1 hold stale values: their scores are set to -inf below.
    for (int64_t r = 0; r < padded_rows; r += 4)
      for (int64_t j = 0; j < width; j += 16) Scores4x16(w, d, r, j);
    // Online softmax, row by row; keys a row does not see weigh 0.
    for (int64_t r = 0; r < rows; ++r) {
      float* pr = w.p[r];
      const int64_t lo = std::max<int64_t>(row_start[r] - key, 0);
      const int64_t hi = std::min<int64_t>(row_end[r] - key, run);
      if (hi <= lo) {
        std::fill(pr, pr + width, 0.0f);
        continue;
      }
      for (int64_t j = 0; j < lo; ++j) pr[j] = kNegInf;
      for (int64_t j = hi; j < width; ++j) pr[j] = kNegInf;
      F8 tile_max = Load(pr);
      for (int64_t j = 8; j < width; j += 8) {
        const F8 x = Load(pr + j);
        tile_max = x > tile_max ? x : tile_max;
      }
      const float new_m = std::max(m[r], MaxOf(tile_max));
      const float rescale = std::exp(m[r] - new_m);    // 0 on the first tile (m = -inf)
      F8 sum = Splat(0);
      for (int64_t j = 0; j < width; j += 8) {
        const F8 x = Exp(Load(pr + j) - Splat(new_m));
        Store(pr + j, x);
        sum += x;
      }
      l[r] = l[r] * rescale + SumOf(sum);
      m[r] = new_m;
      if (rescale != 1.0f)
        for (int64_t i = 0; i < d; i += 8) Store(&w.acc[r][i], Load(&w.acc[r][i]) * Splat(rescale));
    }
    for (int64_t r = 0; r < rows; r += 2) {
      // An odd last row pairs with a spare accumulator row whose weights are 0.
      int64_t r1 = r + 1;
      if (r1 == rows) {
        r1 = kChunkRows;
        std::fill(w.p[r1], w.p[r1] + run, 0.0f);
      }
      int64_t i = 0;
      for (; i + 32 <= d; i += 32) AddValues<4>(w, r, r1, i, run);
      for (; i < d; i += 8) AddValues<1>(w, r, r1, i, run);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / q_per_kv, h = g * q_per_kv + r % q_per_kv;
    float* o = c.out + (t * c.q_heads + h) * d;
    if (l[r] == 0.0f) {                                 // no key seen: 0 and -inf
      std::fill(o, o + d, 0.0f);
      c.lse[t * c.q_heads + h] = kNegInf;
      continue;
    }
    const float inv = 1.0f / l[r];
    for (int64_t i = 0; i < d; ++i) o[i] = w.acc[r][i] * inv;
    c.lse[t * c.q_heads + h] = m[r] + std::log(l[r]);
  }
}

ffi::Error ChunkAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                              ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                              ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> cu_q_lens,
                              ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> starts,
                              ffi::Buffer<ffi::S32> ends, ffi::ResultBuffer<ffi::F32> out,
                              ffi::ResultBuffer<ffi::F32> lse, float sm_scale) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const auto td = page_table.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || td.size() != 2 || vd.size() != 3 ||
      vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2])
    return ffi::Error::InvalidArgument(
        "want q [tokens, q_heads, head_dim], k and v [pages, page_size, kv_heads * "
        "head_dim], page_table [max_seqs, pages_per_seq]");
  Chunks c;
  const int64_t tokens = qd[0], max_seqs = td[0], num_pages = kd[0];
  c.q_heads = qd[1], c.head_dim = qd[2], c.page_size = kd[1], c.pages_per_seq = td[1];
  if (c.head_dim < 8 || c.head_dim > kMaxHeadDim || c.head_dim % 8 || kd[2] % c.head_dim)
    return ffi::Error::InvalidArgument("head_dim must be a multiple of 8, at most 256");
  c.kv_heads = kd[2] / c.head_dim;
  const int64_t q_per_kv = c.kv_heads ? c.q_heads / c.kv_heads : 0;
  if (c.kv_heads < 1 || c.q_heads % c.kv_heads || q_per_kv > kChunkRows ||
      c.page_size < 1 || cu_q_lens.element_count() != max_seqs + 1 ||
      num_seqs.element_count() != 1 || starts.element_count() != tokens ||
      ends.element_count() != tokens)
    return ffi::Error::InvalidArgument(
        "q_heads must be a multiple of kv_heads (at most 64 per K/V head), cu_q_lens "
        "[max_seqs + 1], num_seqs [1], starts and ends [tokens]");
  const int32_t* cu = cu_q_lens.typed_data();
  const int64_t n = *num_seqs.typed_data();
  if (n < 0 || n > max_seqs) return ffi::Error::InvalidArgument("num_seqs outside 0..max_seqs");
  c.q = q.typed_data(), c.k = k.typed_data(), c.v = v.typed_data();
  c.page_table = page_table.typed_data(), c.starts = starts.typed_data();
  c.ends = ends.typed_data(), c.out = out->typed_data(), c.lse = lse->typed_data();
  c.sm_scale = sm_scale;
  // Rows no chunk covers (decodes, padding): 0 and -inf.
  std::fill(c.out, c.out + tokens * c.q_heads * c.head_dim, 0.0f);
  std::fill(c.lse, c.lse + tokens * c.q_heads, kNegInf);
  const int64_t block = std::max<int64_t>(1, kChunkRows / q_per_kv);   // tokens per item
  std::vector<int64_t> items;
  int64_t work = 0;
  for (int64_t s = 0; s < n; ++s) {
    const int64_t t0 = cu[s], t1 = cu[s + 1];
    if (t0 < 0 || t1 < t0 || t1 > tokens)
      return ffi::Error::InvalidArgument("cu_q_lens must rise within 0..tokens");
    if (t1 - t0 < 2) continue;                          // a decode: not this kernel's
    // Every page an item will read must exist: a bad page id is an error, never a stray
    // read. An item reads its rows' keys from the first any of them sees to the last, so
    // the check covers the same span of the sequence's keys.
    int64_t first = std::numeric_limits<int64_t>::max(), last = 0;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t begin = std::max<int32_t>(c.starts[t], 0), end = c.ends[t];
      if (end <= begin) continue;
      first = std::min(first, begin), last = std::max(last, end);
      work += end - begin;
    }
    if (last > c.pages_per_seq * c.page_size)
      return ffi::Error::InvalidArgument("a key past the page table's width");
    for (int64_t slot = first / c.page_size; first < last && slot <= (last - 1) / c.page_size;
         ++slot) {
      const int32_t page = c.page_table[s * c.pages_per_seq + slot];
      if (page < 0 || page >= num_pages)
        return ffi::Error::InvalidArgument("page id outside the cache");
    }
    for (int64_t g = 0; g < c.kv_heads; ++g)
      for (int64_t t = t0; t < t1; t += block)
        items.insert(items.end(), {s, g, t, std::min(block, t1 - t)});
  }
  c.items = items.data();
  const int64_t num_items = int64_t(items.size()) / 4;
  if (num_items == 0) return ffi::Error::Success();
  const int64_t helpers = work * c.q_heads >= 16384 ? num_items : 0;
  RunOnPool<Chunks, ChunkItem>(pool, c, num_items, helpers);
  return ffi::Error::Success();
}

// ------------------------------------------------------------------------ layer matmul

struct Matmul {
  const float* x;      // [rows, k]
  const float* w;      // [k, n]: the layer's matrix
  float* y;            // [rows, n]
  int64_t rows, k, n;
};

constexpr int64_t kBlockColumns = 32;    // columns per GEMM item (two 16-column panels)

// Few rows (a decode step's tokens): the product is as fast as w can be read, and w is read
// fastest front to back. So an item is a share of k, whole rows of w (one contiguous block,
// which the hardware prefetchers stream), added into the item's own partial y in L1; the
// partials are summed at the end. Walking down a block of columns instead (accumulators in
// registers, rows of w n floats apart) read SmolLM2's layers at ~16 GB/s on the 2-core
// EPYC, this at ~24 GB/s (the tied LM head's row-by-row rate): a lone decode's 30 layers of
// projections took 26 ms, now 18 ms.
constexpr int64_t kStreamItemsPerThread = 2;     // items per pool thread: a late helper's
                                                 // share is half its part, not all of it

// acc[R][n] += x[:, d0:d1] @ w[d0:d1, :], U rows of w at a time (one load and store of
// the accumulators per U rows; they stay in L1).
template <int R, int U>
void StreamBlock(const float* x, int64_t x_stride, const float* __restrict__ w, int64_t n,
                 int64_t d0, int64_t d1, float* __restrict__ acc) {
  int64_t d = d0;
  for (; d + U <= d1; d += U) {
    F8 a[R][U];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < U; ++u) a[r][u] = Splat(x[r * x_stride + d + u]);
    const float* w0 = w + d * n;
    for (int64_t c = 0; c < n; c += 8) {
      F8 b[U];
      for (int u = 0; u < U; ++u) b[u] = Load(w0 + u * n + c);
      for (int r = 0; r < R; ++r) {
        F8 t = Load(acc + r * n + c);
        for (int u = 0; u < U; ++u) t += a[r][u] * b[u];
        Store(acc + r * n + c, t);
      }
    }
  }
  for (; d < d1; ++d) {
    const float* w0 = w + d * n;
    for (int r = 0; r < R; ++r) {
      const F8 a = Splat(x[r * x_stride + d]);
      for (int64_t c = 0; c < n; c += 8)
        Store(acc + r * n + c, Load(acc + r * n + c) + a * Load(w0 + c));
    }
  }
}

// Item: rows [d0, d1) of w, the item's share of k, into its own partial y [rows, n].
struct Stream {
  Matmul m;
  int64_t num_items;
  float* partials;     // [num_items, rows, n]
};

void StreamItem(const Stream& s, int64_t item) {
  const Matmul& m = s.m;
  const int64_t d0 = item * m.k / s.num_items, d1 = (item + 1) * m.k / s.num_items;
  float* acc = s.partials + item * m.rows * m.n;
  std::fill(acc, acc + m.rows * m.n, 0.0f);
  for (int64_t r0 = 0; r0 < m.rows; r0 += 4) {
    const float* x = m.x + r0 * m.k;
    float* a = acc + r0 * m.n;
    switch (std::min<int64_t>(4, m.rows - r0)) {
      case 1: StreamBlock<1, 8>(x, m.k, m.w, m.n, d0, d1, a); break;
      case 2: StreamBlock<2, 4>(x, m.k, m.w, m.n, d0, d1, a); break;
      case 3: StreamBlock<3, 4>(x, m.k, m.w, m.n, d0, d1, a); break;
      default: StreamBlock<4, 4>(x, m.k, m.w, m.n, d0, d1, a); break;
    }
  }
}

// y = x @ w for a few rows: k split into kStreamItemsPerThread items per thread of the
// pool, each streaming its rows of w, then the partials summed in item order (the same
// sums whichever thread ran which item).
void StreamMatmul(ffi::ThreadPool& pool, const Matmul& m) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t num_items =
      std::max<int64_t>(1, std::min(m.k / 16, kStreamItemsPerThread * threads));
  const int64_t size = m.rows * m.n;
  std::unique_ptr<float[]> partials(new float[num_items * size]);
  RunOnPool<Stream, StreamItem>(pool, Stream{m, num_items, partials.get()}, num_items,
                                num_items);
  std::copy(partials.get(), partials.get() + size, m.y);
  for (int64_t item = 1; item < num_items; ++item) {
    const float* p = partials.get() + item * size;
    for (int64_t i = 0; i < size; ++i) m.y[i] += p[i];
  }
}

// A GEMM for the rows of a prefill chunk, w read where it lies: XLA:CPU's dot is fast
// (YNNPACK's kernels) but first copies each layer's slice out of the stack, and that copy
// (the whole model's weights, every step) costs as much as the multiplies for a chunk of
// ~100 tokens.
//
// BLIS's layout: an item (32 columns) takes its two 16-column panels of w one block of
// kGemmDepth rows at a time, packs the block contiguously (16 KB, so it stays in L1: read
// in place, rows of w lie n floats apart and, for n a multiple of 1024, all in one L1
// set), then runs the 6-row tiles of x over it.
constexpr int64_t kGemmDepth = 256;
constexpr int64_t kGemmMinRows = 9;     // from here on GemmItem, below StreamMatmul

// y[r0 : r0 + R, 16 columns] (+)= x[r0 : r0 + R, d0 : d0 + depth] @ panel: 12 vectors of
// accumulators (R <= 6), the register tile of 16 vector registers; each step loads 16 of the
// panel's columns (two vectors) and broadcasts one x value per row: 12 multiply-adds for 8
// loads, so the FMA units, not the loads, set the pace.
template <int R>
void GemmTile(const float* __restrict__ panel, const float* x, int64_t x_stride, float* y,
              int64_t y_stride, int64_t depth, bool accumulate) {
  F8 acc[R][2];
  for (int r = 0; r < R; ++r) {
    acc[r][0] = accumulate ? Load(y + r * y_stride) : Splat(0);
    acc[r][1] = accumulate ? Load(y + r * y_stride + 8) : Splat(0);
  }
  for (int64_t d = 0; d < depth; ++d) {
    const F8 b0 = Load(panel + 16 * d), b1 = Load(panel + 16 * d + 8);
    for (int r = 0; r < R; ++r) {
      const F8 a = Splat(x[r * x_stride + d]);
      acc[r][0] += a * b0, acc[r][1] += a * b1;
    }
  }
  for (int r = 0; r < R; ++r) {
    Store(y + r * y_stride, acc[r][0]);
    Store(y + r * y_stride + 8, acc[r][1]);
  }
}

// Item: one block of 32 columns, every row.
void GemmItem(const Matmul& m, int64_t item) {
  alignas(64) float panel[kGemmDepth * 16];
  for (int64_t c0 = item * kBlockColumns; c0 < (item + 1) * kBlockColumns; c0 += 16) {
    for (int64_t d0 = 0; d0 < m.k; d0 += kGemmDepth) {
      const int64_t depth = std::min(kGemmDepth, m.k - d0);
      for (int64_t d = 0; d < depth; ++d)
        std::memcpy(panel + 16 * d, m.w + (d0 + d) * m.n + c0, 16 * sizeof(float));
      for (int64_t r0 = 0; r0 < m.rows; r0 += 6) {
        const float* x = m.x + r0 * m.k + d0;
        float* y = m.y + r0 * m.n + c0;
        const bool more = d0 > 0;
        switch (std::min<int64_t>(6, m.rows - r0)) {
          case 1: GemmTile<1>(panel, x, m.k, y, m.n, depth, more); break;
          case 2: GemmTile<2>(panel, x, m.k, y, m.n, depth, more); break;
          case 3: GemmTile<3>(panel, x, m.k, y, m.n, depth, more); break;
          case 4: GemmTile<4>(panel, x, m.k, y, m.n, depth, more); break;
          case 5: GemmTile<5>(panel, x, m.k, y, m.n, depth, more); break;
          default: GemmTile<6>(panel, x, m.k, y, m.n, depth, more); break;
        }
      }
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

// y[r0 : r0 + R, v0 : v0 + 4] = x[r0 : r0 + R] . w[v0 : v0 + 4] (R <= 2, k a multiple of 8):
// 4R vectors of partial sums, each loaded vector of w used R times and each of x four.
template <int R>
void DotsT(const MatmulT& m, int64_t r0, int64_t v0) {
  F8 acc[4][R];
  for (int u = 0; u < 4; ++u)
    for (int r = 0; r < R; ++r) acc[u][r] = Splat(0);
  const float* w = m.w + v0 * m.k;
  const float* x = m.x + r0 * m.k;
  for (int64_t i = 0; i < m.k; i += 8) {
    F8 xs[R];
    for (int r = 0; r < R; ++r) xs[r] = Load(x + r * m.k + i);
    for (int u = 0; u < 4; ++u) {
      const F8 b = Load(w + u * m.k + i);
      for (int r = 0; r < R; ++r) acc[u][r] += xs[r] * b;
    }
  }
  for (int u = 0; u < 4; ++u)
    for (int r = 0; r < R; ++r) m.y[(r0 + r) * m.n + v0 + u] = SumOf(acc[u][r]);
}

// Item: outputs [item * 64, item * 64 + 64) of every row, four rows of w at a time (they
// stay in L1 while the x rows, two at a time, take their dot products with them; one x
// row a dot product at a time loaded two vectors per multiply-add, and 8 rows of
// SmolLM2's tied head took 13.9 ms against 4.9 ms for one).
void MatmulTItem(const MatmulT& m, int64_t item) {
  const int64_t v0 = item * kBlockOutputs, v1 = std::min(m.n, v0 + kBlockOutputs);
  int64_t v = v0;
  if (m.k % 8 == 0) {
    for (; v + 4 <= v1; v += 4) {
      int64_t r = 0;
      for (; r + 2 <= m.rows; r += 2) DotsT<2>(m, r, v);
      if (r < m.rows) DotsT<1>(m, r, v);
    }
  }
  for (; v < v1; ++v) {
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
  if (m.rows >= kGemmMinRows)
    RunOnPool<Matmul, GemmItem>(pool, m, blocks, blocks);
  else
    StreamMatmul(pool, m);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(MedhaCpuChunkAttention, ChunkAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v
                                  .Arg<ffi::Buffer<ffi::S32>>()   // page_table
                                  .Arg<ffi::Buffer<ffi::S32>>()   // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()   // num_seqs
                                  .Arg<ffi::Buffer<ffi::S32>>()   // starts
                                  .Arg<ffi::Buffer<ffi::S32>>()   // ends
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out
                                  .Ret<ffi::Buffer<ffi::F32>>()   // lse
                                  .Attr<float>("sm_scale"));
