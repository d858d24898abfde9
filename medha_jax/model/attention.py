"""The model's attention entry point: the paged kernel, per device when the mesh is sharded.

The jnp reference is plain XLA, so GSPMD partitions it from the operands' shardings. A
Pallas kernel is opaque to GSPMD, so on a sharded mesh it runs inside a shard_map over the
attention heads: each device attends its own query heads with their own K/V heads. The
specs come from the logical-axis rules; the mesh is the one the caller traces under
(`jax.set_mesh`).
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import PartitionSpec

from meshes import DEFAULT_RULES, LogicalRules
from pallas_kernels import ragged_paged_attention
from pallas_kernels.block_sizes import resolve


def paged_attention(q, k_pages, v_pages, meta, *, sm_scale: float, impl: str,
                    rules: LogicalRules = DEFAULT_RULES):
    """q: [T, H, hd]; k_pages, v_pages: [P, page_size, K, hd] -> (out [T, H, hd], lse [T, H])."""
    kernel = functools.partial(ragged_paged_attention, sm_scale=sm_scale, impl=impl)
    args = (q, k_pages, v_pages, meta.page_table, meta.cu_q_lens, meta.kv_lens, meta.num_seqs)
    resolved, _ = resolve(impl, None, head_dim=q.shape[-1], page_size=k_pages.shape[1])
    mesh = jax.sharding.get_abstract_mesh()
    if resolved == "reference" or mesh.empty or mesh.size == 1:
        return kernel(*args)

    heads_axis, kv_heads_axis = rules.mesh_axis("heads"), rules.mesh_axis("kv_heads")
    degree = mesh.shape[heads_axis] if heads_axis else 1
    num_heads, num_kv_heads = q.shape[1], k_pages.shape[2]
    if heads_axis != kv_heads_axis or num_heads % degree or num_kv_heads % degree:
        # K/V heads are replicated across the head axis (tp > kv_heads): a device's query
        # heads then need K/V heads another device also holds, so there is no per-device
        # GQA split; the reference handles it under GSPMD.
        return ragged_paged_attention(*args, sm_scale=sm_scale, impl="reference")
    # Pages are gathered over their axis (kvp) here: the kernel indexes pages by global id.
    q_spec = PartitionSpec(None, heads_axis, None)
    kv_spec = PartitionSpec(None, None, kv_heads_axis, None)
    lse_spec = PartitionSpec(None, heads_axis)
    replicated = PartitionSpec()
    sharded_kernel = jax.shard_map(
        kernel, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec) + (replicated,) * 4,
        out_specs=(q_spec, lse_spec), check_vma=False)
    return sharded_kernel(*args)
