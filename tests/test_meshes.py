import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from meshes import MESH_AXES, ParallelConfig
from meshes import DEFAULT_RULES, LogicalRules, initialize_distributed, make_mesh, parallel_config_of


def test_mesh_axes_in_order_with_tp_innermost():
    mesh = make_mesh(ParallelConfig(dp=1, spp=2, kvp=1, cp=1, tp=4))
    assert mesh.axis_names == MESH_AXES
    assert dict(mesh.shape) == {"dp": 1, "spp": 2, "kvp": 1, "cp": 1, "tp": 4}
    # tp innermost: neighbouring devices along tp have consecutive ids.
    devices = np.asarray(mesh.devices).reshape(2, 4)
    assert [d.id for d in devices[0]] == [0, 1, 2, 3]
    assert parallel_config_of(mesh) == ParallelConfig(spp=2, tp=4)


def test_mesh_of_size_one_is_valid():
    mesh = make_mesh(ParallelConfig())
    assert mesh.size == 1


def test_mesh_errors_name_the_counts():
    with pytest.raises(ValueError, match="needs 16 devices but only 8"):
        make_mesh(ParallelConfig(tp=16))
    with pytest.raises(ValueError, match="multiply to 4 but 8 devices were given"):
        make_mesh(ParallelConfig(tp=4), devices=jax.devices())


def test_parallel_config_validation_and_parsing():
    assert ParallelConfig.parse("tp=8,spp=2") == ParallelConfig(tp=8, spp=2)
    assert ParallelConfig.parse("") == ParallelConfig()
    with pytest.raises(ValueError, match="tp must be an int >= 1"):
        ParallelConfig(tp=0)
    with pytest.raises(ValueError, match="bad parallel spec 'pp=2'"):
        ParallelConfig.parse("pp=2")
    with pytest.raises(ValueError, match="bad parallel degree"):
        ParallelConfig.parse("tp=x")


def test_rules_map_logical_axes_and_reject_collisions():
    assert DEFAULT_RULES.spec(("layers", "embed", "heads", "head_dim")) == \
        PartitionSpec("spp", None, "tp", None)
    with pytest.raises(ValueError, match="a mesh axis may shard at most one dimension"):
        DEFAULT_RULES.spec(("heads", "vocab"))
    with pytest.raises(ValueError, match="unknown logical axis"):
        LogicalRules(rules=(("batch", "dp"),))
    with pytest.raises(ValueError, match="mesh axis must be one of"):
        LogicalRules(rules=(("heads", "model"),))
    with pytest.raises(ValueError, match="appears twice"):
        LogicalRules(rules=(("heads", "tp"), ("heads", None)))


def test_indivisible_dimension_is_an_error():
    mesh = make_mesh(ParallelConfig(tp=4))
    with pytest.raises(ValueError, match="dimension heads=9 is not divisible by tp=4"):
        DEFAULT_RULES.sharding(mesh, (576, 9, 64), ("embed", "heads", "head_dim"))
    with pytest.raises(ValueError, match="dimension kv_heads=2 is not divisible by tp=4"):
        DEFAULT_RULES.sharding(mesh, (576, 2, 64), ("embed", "kv_heads", "head_dim"))


def test_meshes_imports_nothing_from_medha_jax():
    import subprocess
    import sys

    code = ("import sys, meshes; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'medha_jax'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_initialize_distributed_is_a_no_op_on_one_host(monkeypatch):
    for var in ("MEDHA_COORDINATOR", "TPU_WORKER_HOSTNAMES", "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert initialize_distributed() is False
    with pytest.raises(ValueError, match="needs the process count"):
        initialize_distributed("10.0.0.1:1234")
