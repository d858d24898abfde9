"""BlockSizes validation, the tile table, device kinds, and the Triton tile constraints.

The GPU entries are checked by lowering the kernel for CUDA from this CPU host (Pallas ->
Triton IR runs without a GPU; compiling to PTX and running would need one)."""

import logging
import types

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import BlockSizes, decode_attention, ragged_paged_attention
from pallas_kernels.block_sizes import (GPU_KINDS, TILE_TABLE, TPU_KINDS, TileDefaults,
                                        check_native_tiles, device_kind_of)
from pallas_kernels.dispatch import block_sizes_for

HEAD_DIMS, PAGE_SIZES = (64, 128), (8, 16, 32)


def fake_device(platform, device_kind):
    return types.SimpleNamespace(platform=platform, device_kind=device_kind)


def test_block_sizes_validate_and_hash():
    assert BlockSizes(block_q=16, kv_pages_per_block=4).block_kv(16) == 64
    assert hash(BlockSizes(block_q=1, kv_pages_per_block=1)) == hash(
        BlockSizes(block_q=1, kv_pages_per_block=1, num_kv_splits=1))
    for bad in (dict(block_q=0, kv_pages_per_block=1), dict(block_q=4, kv_pages_per_block=2.0),
                dict(block_q=4, kv_pages_per_block=1, num_kv_splits=True)):
        with pytest.raises(ValueError, match="must be a positive int"):
            BlockSizes(**bad)
    with pytest.raises(ValueError, match="keys_wide=0"):
        TileDefaults(block_q=16, keys_narrow=64, keys_wide=0, num_kv_splits=1)


def test_table_has_every_kind_and_sizes_follow_head_dim():
    assert set(TILE_TABLE) == {"cpu", "interpret", "interpret-tpu", *GPU_KINDS, *TPU_KINDS}
    h100 = TILE_TABLE["h100"]
    assert h100.block_sizes(64, 16).block_kv(16) == h100.keys_narrow
    assert h100.block_sizes(128, 16).block_kv(16) == h100.keys_wide
    # A page larger than the tile still makes a one-page tile.
    assert TILE_TABLE["a100"].block_sizes(128, 256).kv_pages_per_block == 1
    with pytest.raises(ValueError, match="head_dim=0"):
        h100.block_sizes(0, 16)


@pytest.mark.parametrize("kind", [*GPU_KINDS, "interpret"])
def test_kernel_entries_meet_the_triton_constraints(kind):
    for head_dim in HEAD_DIMS:
        for page_size in PAGE_SIZES:
            check_native_tiles(TILE_TABLE[kind].block_sizes(head_dim, page_size),
                               head_dim=head_dim, page_size=page_size)


def test_check_native_tiles_names_the_values():
    with pytest.raises(ValueError, match="head_dim=96"):
        check_native_tiles(BlockSizes(block_q=16, kv_pages_per_block=2), head_dim=96,
                           page_size=16)
    with pytest.raises(ValueError, match="kv_pages_per_block=3"):
        check_native_tiles(BlockSizes(block_q=16, kv_pages_per_block=3), head_dim=64,
                           page_size=16)
    with pytest.raises(ValueError, match="block_kv=8"):
        check_native_tiles(BlockSizes(block_q=16, kv_pages_per_block=2), head_dim=64,
                           page_size=4)


@pytest.mark.parametrize("device_kind, platform, want", [
    ("NVIDIA H100 80GB HBM3", "gpu", "h100"),
    ("NVIDIA H100 PCIe", "gpu", "h100"),
    ("NVIDIA H200", "gpu", "h200"),
    ("NVIDIA GH200 480GB", "gpu", "h200"),
    ("NVIDIA A100-SXM4-80GB", "gpu", "a100"),
    ("TPU v5 lite", "tpu", "tpu-v5e"),
    ("TPU v5p", "tpu", "tpu-v5p"),
    ("cpu", "cpu", "cpu"),
])
def test_device_kind_of(device_kind, platform, want):
    assert device_kind_of(fake_device(platform, device_kind)) == want


def test_unknown_devices_fall_back_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="pallas_kernels.block_sizes"):
        assert device_kind_of(fake_device("gpu", "NVIDIA L4 (test)")) == "a100"
        assert device_kind_of(fake_device("tpu", "TPU v4 (test)")) == "tpu-v5e"
    assert "'NVIDIA L4 (test)'" in caplog.text and "'TPU v4 (test)'" in caplog.text
    assert device_kind_of() == "cpu"      # this host


# The device the Triton lowering targets from this CPU host. jax >= 0.11 reads the GPU's
# compute capability while lowering and, with no GPU present, needs it named (jax 0.10 took
# a default); an H100's kind names sm_90.
ABSTRACT_GPU = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=None,
                                           platform="gpu")


def lower_for_cuda(fn, *args) -> str:
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=ABSTRACT_GPU)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("kind", GPU_KINDS)
def test_kernel_lowers_for_cuda_with_every_gpu_entry(kind):
    """Every op of the kernel has a Triton lowering and every tile is a legal Triton tensor,
    for the table's tiles of head_dim 64 and 128 (one causal, one prefix layout) and the
    decode kernel."""
    sds = jax.ShapeDtypeStruct
    page_size, max_seqs = 16, 8
    for head_dim, kv_heads, causal in ((128, 8, True), (64, 2, False)):
        tiles = block_sizes_for("pallas", kind, head_dim, page_size)
        cache = sds((256, page_size, kv_heads, head_dim), jnp.bfloat16)
        ragged = (sds((64, 4 * kv_heads, head_dim), jnp.bfloat16), cache, cache,
                  sds((max_seqs, 40), jnp.int32), sds((max_seqs + 1,), jnp.int32),
                  sds((max_seqs,), jnp.int32), sds((1,), jnp.int32))
        text = lower_for_cuda(lambda *a: ragged_paged_attention(
            *a, sm_scale=0.1, impl="pallas", block_sizes=tiles, causal=causal), *ragged)
        assert text.count("__gpu$xla.gpu.triton") == 1
    decode = (sds((max_seqs, 4 * kv_heads, head_dim), jnp.bfloat16), cache, cache,
              sds((max_seqs, 40), jnp.int32), sds((max_seqs,), jnp.int32))
    text = lower_for_cuda(lambda *a: decode_attention(*a, sm_scale=0.1, impl="pallas",
                                                      block_sizes=tiles), *decode)
    assert text.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("kind", GPU_KINDS)
def test_decode_prefill_split_lowers_for_cuda(kind):
    """With num_decodes the step holds two Triton kernels (decode, prefill-sized ragged
    blocks: 128 rows at GQA 8 on H100/H200, so the 8-warp configuration) in one program."""
    sds = jax.ShapeDtypeStruct
    page_size, max_seqs, kv_heads, head_dim = 16, 8, 2, 128
    tiles = block_sizes_for("pallas", kind, head_dim, page_size)
    cache = sds((256, page_size, kv_heads, head_dim), jnp.bfloat16)
    args = (sds((256, 8 * kv_heads, head_dim), jnp.bfloat16), cache, cache,
            sds((max_seqs, 40), jnp.int32), sds((max_seqs + 1,), jnp.int32),
            sds((max_seqs,), jnp.int32), sds((1,), jnp.int32), sds((1,), jnp.int32))
    text = lower_for_cuda(lambda q, k, v, pt, cu, kl, ns, nd: ragged_paged_attention(
        q, k, v, pt, cu, kl, ns, sm_scale=0.1, impl="pallas", block_sizes=tiles,
        num_decodes=nd), *args)
    assert text.count("__gpu$xla.gpu.triton") == 2


def lower_for_tpu(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()


@pytest.mark.parametrize("kind", TPU_KINDS)
def test_tpu_kernel_lowers_for_tpu_with_every_tpu_entry(kind):
    """Pallas -> Mosaic lowering of the TPU kernel from this CPU host, for the table's
    tiles (bf16 and f32, head_dim 64 and 128, page sizes 16 and 64, causal and prefix, and
    the decode/prefill split). What only a TPU checks: Mosaic's own layout passes and the
    compile to the chip, which run in libtpu."""
    sds = jax.ShapeDtypeStruct
    max_seqs = 8
    for dtype, head_dim, page_size, causal in ((jnp.bfloat16, 128, 16, True),
                                               (jnp.float32, 64, 64, False)):
        tiles = block_sizes_for("pallas-tpu", kind, head_dim, page_size)
        cache = sds((256, page_size, 2, head_dim), dtype)
        args = (sds((128, 16, head_dim), dtype), cache, cache, sds((max_seqs, 64), jnp.int32),
                sds((max_seqs + 1,), jnp.int32), sds((max_seqs,), jnp.int32),
                sds((1,), jnp.int32), sds((1,), jnp.int32))
        text = lower_for_tpu(lambda q, k, v, pt, cu, kl, ns, nd: ragged_paged_attention(
            q, k, v, pt, cu, kl, ns, sm_scale=0.1, impl="pallas-tpu", block_sizes=tiles,
            causal=causal, num_decodes=nd), *args)
        assert text.count("tpu_custom_call") == 2      # decode and prefill kernels
        text = lower_for_tpu(lambda *a: ragged_paged_attention(
            *a, sm_scale=0.1, impl="pallas-tpu", block_sizes=tiles, causal=causal), *args[:7])
        assert text.count("tpu_custom_call") == 1


_IMPL_OF_KIND = {"cpu": "xla", "interpret": "interpret", "interpret-tpu": "interpret-tpu",
                 **{k: "pallas" for k in GPU_KINDS}, **{k: "pallas-tpu" for k in TPU_KINDS}}


@pytest.mark.parametrize("kind", sorted(TILE_TABLE))
def test_prefill_query_block_is_the_block_the_prefill_path_runs(kind, monkeypatch):
    """What Engine.query_block_tokens gives the packer (prefill_query_block) is the query
    block the prefill path hands its kernel in a step whose decodes come first (on main it
    was block_q, the decode path's: 16 on an H100 where prefill runs in 32-token blocks
    for 4 query heads per KV head, 8 on a v5e where it runs in 64)."""
    from pallas_kernels import attention
    from pallas_kernels.dispatch import prefill_query_block
    impl = _IMPL_OF_KIND[kind]
    tokens, q_heads, kv_heads, head_dim, page_size = 256, 8, 2, 128, 16
    tiles = block_sizes_for(impl, kind, head_dim, page_size)
    seen = []

    def capture(*args, block_sizes, **kw):
        seen.append(block_sizes.block_q)
        return jnp.zeros(args[0].shape, jnp.float32), jnp.zeros(args[0].shape[:2], jnp.float32)

    jax.clear_caches()      # a kind with another's tiles would hit its jit cache
    monkeypatch.setattr(attention, "ragged_paged_attention_xla", capture)
    monkeypatch.setattr(attention, "_ragged_kernel", lambda impl: capture)
    monkeypatch.setattr(attention, "_decode_kernel", lambda impl: capture)
    q = jax.ShapeDtypeStruct((tokens, q_heads, head_dim), jnp.float32)
    pages = jax.ShapeDtypeStruct((64, page_size, kv_heads, head_dim), jnp.float32)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)   # noqa: E731
    jax.eval_shape(lambda q, k, v, pt, cu, kl, ns, nd: ragged_paged_attention(
        q, k, v, pt, cu, kl, ns, sm_scale=1.0, impl=impl, block_sizes=tiles, num_decodes=nd),
        q, pages, pages, i32(8, 16), i32(9), i32(8), i32(1), i32(1))
    assert seen, "the prefill path called no kernel"
    assert prefill_query_block(impl, tiles, q_per_kv=q_heads // kv_heads,
                               num_tokens=tokens) == seen[0]
