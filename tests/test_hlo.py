"""Reading collectives and their sizes out of optimized HLO."""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from medha_jax import hlo


def compiled_text(fn, *args):
    return jax.jit(fn).lower(*args).compile().as_text()


def test_collectives_sizes_and_loop_counts():
    mesh = jax.make_mesh((2, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:4])

    def body(x):                                               # x: [4, 8] per device
        def step(i, acc):
            return acc + jax.lax.psum(acc * i, "a")
        looped = jax.lax.fori_loop(0, 5, step, x)
        passed = jax.lax.ppermute(x, "b", [(0, 1), (1, 0)])
        gathered = jax.lax.all_gather(x, "a", tiled=True)      # [8, 8]
        return looped + passed, gathered

    fn = jax.shard_map(body, mesh=mesh, in_specs=P("a", "b"),
                       out_specs=(P("a", "b"), P(None, "b")), check_vma=False)
    found = hlo.collectives(compiled_text(fn, jnp.ones((8, 16), jnp.float32)))
    by_op = {c.op: c for c in found}
    assert set(by_op) == {"all-reduce", "collective-permute", "all-gather"}
    assert by_op["all-reduce"].bytes == 4 * 8 * 4 and by_op["all-reduce"].count == 5
    assert by_op["collective-permute"].bytes == 4 * 8 * 4 and by_op["collective-permute"].count == 1
    assert by_op["all-gather"].bytes == 8 * 8 * 4
    assert hlo.bytes_per_call(compiled_text(fn, jnp.ones((8, 16), jnp.float32))) == \
        5 * 128 + 128 + 256


def test_array_bytes_of_tuples_and_dtypes():
    assert hlo.array_bytes("(f32[4,8]{1,0}, bf16[3]{0}, s32[])") == 4 * 32 + 2 * 3 + 4


def test_copies_lists_transposes_and_copies_with_their_loop_counts():
    def fn(x, y):                                              # x: [64, 64], y: [4, 4]
        def step(i, acc):
            return jnp.sin(acc.T) + i                          # a [64, 64] transpose per trip
        return jax.lax.fori_loop(0, 3, step, x), y.T           # y.T: under min_bytes

    text = compiled_text(fn, jnp.ones((64, 64), jnp.float32), jnp.ones((4, 4), jnp.float32))
    found = hlo.copies(text, min_bytes=64 * 64 * 4)
    assert found and all(c.bytes == 64 * 64 * 4 for c in found), found
    assert {c.op for c in found} <= set(hlo.COPY_OPS)
    assert any(c.count == 3 for c in found), found             # inside the loop
    assert any(c.bytes == 4 * 4 * 4 for c in hlo.copies(text))  # the small one, unfiltered


def test_replica_groups_in_each_of_xlas_spellings():
    # Listed; as an iota (with and without a transpose); as a mesh and its spanned axes, the
    # spelling of jax >= 0.11's XLA. Groups over axis "b" of a (2, 2) mesh are {0,1},{2,3};
    # over "a", {0,2},{1,3}.
    assert hlo.replica_groups("x = f32[4] all-reduce(y), replica_groups={{0,1},{2,3}}, "
                              "to_apply=%r") == [(0, 1), (2, 3)]
    assert hlo.replica_groups("replica_groups=[2,2]<=[4], x") == [(0, 1), (2, 3)]
    assert hlo.replica_groups("replica_groups=[2,2]<=[2,2]T(1,0), x") == [(0, 2), (1, 3)]
    assert hlo.replica_groups("replica_groups=[1,8]<=[8]") == [tuple(range(8))]
    mesh = "replica_groups=mesh['a'=2,'b'=2] {%s}, use_global_device_ids=true"
    assert hlo.replica_groups(mesh % "'b'") == [(0, 1), (2, 3)]
    assert hlo.replica_groups(mesh % "'a'") == [(0, 2), (1, 3)]
    assert hlo.replica_groups(mesh % "'a','b'") == [(0, 1, 2, 3)]
    assert hlo.replica_groups("x = f32[4] add(y, z)") is None


def test_replica_groups_of_a_compiled_program():
    # Whatever spelling this jaxlib prints, the groups read back are the axes' device groups.
    mesh = jax.make_mesh((2, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:4])

    def body(x):
        return jax.lax.psum(x, "b"), jax.lax.psum(x, ("a", "b"))

    fn = jax.shard_map(body, mesh=mesh, in_specs=P("a", "b"), out_specs=(P("a"), P()),
                       check_vma=False)
    lines = [line for line in compiled_text(fn, jnp.ones((8, 16), jnp.float32)).splitlines()
             if " all-reduce(" in line or " all-reduce-start(" in line]
    assert sorted(map(hlo.replica_groups, lines)) == [[(0, 1), (2, 3)], [(0, 1, 2, 3)]]
