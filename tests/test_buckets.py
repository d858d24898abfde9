"""medha_jax.buckets: the ladders, bucket_for / padded_size, the reachable shapes; no JAX."""

import pathlib
import subprocess
import sys

import pytest

from medha_jax import buckets
from medha_jax.buckets import BucketLadder, bucket_for, geometric_buckets, padded_size


def test_geometric_buckets_and_bucket_for():
    assert geometric_buckets(16, 2048) == (16, 32, 64, 128, 256, 512, 1024, 2048)
    assert geometric_buckets(16, 3000) == (16, 32, 64, 128, 256, 512, 1024, 2048, 3000)
    assert geometric_buckets(1, 256, 4) == (1, 4, 16, 64, 256)
    assert geometric_buckets(5, 5) == (5,)
    assert [bucket_for(n, (16, 32, 64)) for n in (0, 1, 16, 17, 33, 64)] == [16, 16, 16, 32, 64, 64]
    with pytest.raises(ValueError, match=r"tokens n=65 exceeds the largest bucket 64 of \(16, 32, 64\)"):
        bucket_for(65, (16, 32, 64), "tokens")
    with pytest.raises(ValueError, match="seqs n=-1 must be >= 0"):
        bucket_for(-1, (16,), "seqs")
    with pytest.raises(ValueError, match="smallest=0"):
        geometric_buckets(0, 8)
    with pytest.raises(ValueError, match="factor=1"):
        geometric_buckets(1, 8, 1)


def test_padded_size_keeps_zero_and_passes_through_without_buckets():
    # What the scheduler prices: an empty batch costs no step, the simulator has no buckets.
    assert padded_size(0, (64, 128)) == 0
    assert padded_size(7, None) == 7
    assert [padded_size(n, (64, 128, 256)) for n in (1, 64, 65, 129, 256)] == [64, 64, 128, 256, 256]
    with pytest.raises(ValueError, match="exceeds the largest bucket 256"):
        padded_size(257, (64, 128, 256))


def test_scheduler_pads_with_the_shared_buckets():
    # One bucket lookup for the engine and the scheduler: the predictor's and the packer's
    # padded sizes are the engine's.
    from medha_jax.scheduler import packer, predictor
    assert predictor.padded_size is padded_size and packer.padded_size is padded_size
    ladder = BucketLadder.from_limits(max_tokens=512, max_seqs=8, max_pages_per_seq=32)
    features = predictor.BatchFeatures().plus_chunk(100, 0, True, ladder.token_buckets)
    assert features.padded_tokens == ladder.token_bucket(100) == 128


@pytest.mark.parametrize("kwargs, match", [
    (dict(token_buckets=(), seq_buckets=(1,), width_buckets=(1,)), "token_buckets must not be"),
    (dict(token_buckets=(16, 16), seq_buckets=(1,), width_buckets=(1,)), "strictly increasing"),
    (dict(token_buckets=(16,), seq_buckets=(0, 4), width_buckets=(1,)), "positive ints"),
    (dict(token_buckets=(16,), seq_buckets=(32,), width_buckets=(1,)), "max_seqs=32 cannot exceed"),
])
def test_ladder_validates(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BucketLadder(**kwargs)


def test_ladder_lookups_name_what_overflowed():
    ladder = BucketLadder(token_buckets=(4, 8), seq_buckets=(2,), width_buckets=(3,))
    assert (ladder.token_bucket(5), ladder.seq_bucket(1), ladder.width_bucket(3)) == (8, 2, 3)
    with pytest.raises(ValueError, match="page-table width n=4 exceeds the largest bucket 3"):
        ladder.width_bucket(4)
    with pytest.raises(ValueError, match="seqs n=3 exceeds"):
        ladder.seq_bucket(3)


def test_all_shapes_are_exactly_the_reachable_ones():
    ladder = BucketLadder(token_buckets=(4, 8, 16), seq_buckets=(1, 2, 8, 12), width_buckets=(2, 5))
    reachable = {(ladder.token_bucket(t), ladder.seq_bucket(s, ladder.token_bucket(t)), w)
                 for t in range(1, 17) for s in range(1, min(t, 12) + 1) for w in (2, 5)}
    shapes = ladder.all_shapes()
    assert len(shapes) == len(set(shapes)) and set(shapes) == reachable
    assert (8, 12, 2) not in shapes                           # 9..12 sequences need 9+ tokens
    # 3 or 4 sequences in 4 tokens: the rung of 8 capped at the step's 4 tokens.
    assert (4, 4, 2) in shapes and (4, 8, 2) not in shapes


def test_seq_bucket_is_capped_at_the_steps_token_bucket():
    ladder = BucketLadder.from_limits(max_tokens=512, max_seqs=32, max_pages_per_seq=64,
                                      min_tokens=1)
    assert ladder.token_buckets[:5] == (1, 2, 4, 8, 16) and ladder.seq_buckets == (8, 32)
    steps = {n: (ladder.token_bucket(n), ladder.seq_bucket(n, ladder.token_bucket(n)))
             for n in (1, 2, 3, 5, 9, 17)}      # n decodes: n tokens, n sequences
    assert steps == {1: (1, 1), 2: (2, 2), 3: (4, 4), 5: (8, 8), 9: (16, 16), 17: (32, 32)}
    assert ladder.seq_bucket(3) == 8                          # uncapped without a token bucket
    assert ladder.seq_bucket(2, 64) == 8                      # the cap only lowers a rung


def test_default_ladder_sizes():
    ladder = BucketLadder.from_limits(max_tokens=2048, max_seqs=256, max_pages_per_seq=512)
    assert ladder.token_buckets == (16, 32, 64, 128, 256, 512, 1024, 2048)
    assert ladder.seq_buckets == (8, 32, 128, 256)
    assert ladder.width_buckets == (16, 64, 256, 512)
    assert len(ladder.all_shapes()) == 104
    small = BucketLadder.from_limits(max_tokens=256, max_seqs=16, max_pages_per_seq=128)
    assert len(small.all_shapes()) == 30
    tiny = BucketLadder.from_limits(max_tokens=8, max_seqs=4, max_pages_per_seq=2)
    assert tiny == BucketLadder((8,), (4,), (2,))


def test_module_imports_no_jax():
    # The scheduler prices batches with these buckets and must not need JAX. Loaded from
    # its file alone, so that what the package's __init__ imports does not count.
    path = pathlib.Path(buckets.__file__)
    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('buckets_alone', {str(path)!r})\n"
            "module = sys.modules['buckets_alone'] = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(module)\n"
            "assert module.bucket_for(3, (2, 4)) == 4\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'numpy')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_cp_page_rungs_reach_the_rank_pool_and_only_what_s_x_w_pages_can_fill():
    ladder = BucketLadder.from_limits(max_tokens=64, max_seqs=8, max_pages_per_seq=64,
                                      cp_pages=300)
    # A rank's pass-KV message holds each of its pages once: at most its pool of 300.
    assert ladder.cp_page_buckets == (16, 64, 256, 300)
    assert ladder.cp_page_bucket(0) == 16 and ladder.cp_page_bucket(65) == 256
    shapes = ladder.all_shapes()
    assert all(len(s) == 4 for s in shapes)
    # 8 sequences of 16 pages hold at most 128 distinct pages: rungs 16, 64, 256 reachable.
    assert {c for t, s, w, c in shapes if (s, w) == (8, 16)} == {16, 64, 256}
    assert {c for t, s, w, c in shapes if (s, w) == (8, 64)} == {16, 64, 256, 300}
    with pytest.raises(ValueError, match="no cp_page_buckets"):
        BucketLadder.from_limits(max_tokens=64, max_seqs=8,
                                 max_pages_per_seq=64).cp_page_bucket(3)


def test_startup_shapes_are_a_lone_decode_and_a_short_prompts_first_step():
    ladder = BucketLadder.from_limits(max_tokens=512, max_seqs=32, max_pages_per_seq=64,
                                      min_tokens=1)
    assert ladder.startup_shapes() == [(1, 1, 16), (16, 8, 16)]
    assert set(ladder.startup_shapes()) <= set(ladder.all_shapes())
    # A ladder from 16 tokens: its smallest shape is both.
    assert BucketLadder.from_limits(max_tokens=512, max_seqs=32,
                                    max_pages_per_seq=64).startup_shapes() == [(16, 8, 16)]
