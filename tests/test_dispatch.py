"""dispatch: "auto" per back-end, the tiles each implementation takes, and the checks."""

import pytest

from pallas_kernels import BlockSizes
from pallas_kernels.block_sizes import TILE_TABLE
from pallas_kernels.dispatch import (IMPLS, block_sizes_for, choose_attention,
                                     describe_impl_choice, resolve_impl)


def test_auto_per_backend_and_explicit_names():
    assert IMPLS == ("auto", "xla", "pallas", "interpret", "pallas-tpu", "interpret-tpu")
    assert resolve_impl("auto", "gpu") == resolve_impl("auto", "cuda") == "pallas"
    assert resolve_impl("auto", "tpu") == "pallas-tpu"
    assert resolve_impl("auto", "cpu") == "xla"
    assert resolve_impl("auto") == "xla"                    # this CPU host
    assert resolve_impl("interpret", "cpu") == "interpret"
    assert resolve_impl("interpret-tpu", "cpu") == "interpret-tpu"
    assert resolve_impl("pallas", "gpu") == "pallas"
    assert resolve_impl("pallas-tpu", "tpu") == "pallas-tpu"
    with pytest.raises(ValueError, match="'pallas' needs a GPU; this back-end is 'tpu'"):
        resolve_impl("pallas", "tpu")
    with pytest.raises(ValueError, match="'pallas-tpu' needs a TPU; this back-end is 'gpu'"):
        resolve_impl("pallas-tpu", "gpu")
    with pytest.raises(ValueError, match="impl='reference' must be one of"):
        resolve_impl("reference", "cpu")


def test_describe_says_why():
    assert describe_impl_choice("xla", "xla", "gpu") == "xla (as asked)"
    assert "Pallas kernel on GPUs" in describe_impl_choice("auto", "pallas", "gpu")
    assert "Mosaic-TPU kernel on TPUs" in describe_impl_choice("auto", "pallas-tpu", "tpu")
    assert "XLA path on cpu" in describe_impl_choice("auto", "xla", "cpu")


def test_block_sizes_for_each_impl():
    tiles = lambda kind: TILE_TABLE[kind].block_sizes(128, 16)
    assert block_sizes_for("xla", "cpu", 128, 16) == tiles("cpu")
    assert block_sizes_for("xla", "tpu-v5p", 128, 16) == tiles("cpu")   # XLA path on a TPU
    assert block_sizes_for("xla", "h100", 128, 16) == tiles("cpu")      # XLA path on a GPU
    assert block_sizes_for("pallas", "a100", 128, 16) == tiles("a100")
    assert block_sizes_for("pallas", "cpu", 128, 16) == tiles("h100")   # lowering from a CPU
    assert block_sizes_for("interpret", "h200", 128, 16) == tiles("interpret")
    assert block_sizes_for("pallas-tpu", "tpu-v5p", 128, 16) == tiles("tpu-v5p")
    assert block_sizes_for("pallas-tpu", "cpu", 128, 16) == tiles("tpu-v5e")
    assert block_sizes_for("interpret-tpu", "cpu", 128, 16) == tiles("interpret-tpu")
    assert tiles("tpu-v5p") != tiles("tpu-v5e") != tiles("cpu")
    with pytest.raises(ValueError, match="impl='auto'"):
        block_sizes_for("auto", "cpu", 64, 16)
    with pytest.raises(ValueError, match="device_kind='v100'"):
        block_sizes_for("xla", "v100", 64, 16)


def test_choose_attention_fills_in_and_checks_tiles():
    assert choose_attention("auto", None, head_dim=64, page_size=16) == (
        "xla", TILE_TABLE["cpu"].block_sizes(64, 16))
    odd = BlockSizes(block_q=3, kv_pages_per_block=3)
    assert choose_attention("interpret", odd, head_dim=64, page_size=4) == ("interpret", odd)
    with pytest.raises(ValueError, match="block_kv=8"):
        choose_attention("pallas", BlockSizes(block_q=16, kv_pages_per_block=2), head_dim=64,
                         page_size=4)
    with pytest.raises(ValueError, match="block_q=12"):
        choose_attention("interpret-tpu", BlockSizes(block_q=12, kv_pages_per_block=2),
                         head_dim=64, page_size=16)
    with pytest.raises(ValueError, match="page_size=4"):
        choose_attention("pallas-tpu", BlockSizes(block_q=8, kv_pages_per_block=2),
                         head_dim=64, page_size=4)
