"""benchmarks/gpu_check.py (`make gpu-check`) on the CPU: the GPU kernel in Pallas interpret
mode against the oracle, the engine's greedy tokens against the XLA path's, the kernel table
and the decode-step breakdown, all in one run; so the GPU command cannot rot unseen."""

import json

import pytest

from benchmarks import gpu_check


@pytest.mark.slow
def test_gpu_check_runs_on_the_cpu_in_interpret_mode(tmp_path, capsys):
    path = tmp_path / "gpu_check.json"
    report = gpu_check.main(["--quick", "--seed", "3", "--json", str(path)])
    assert json.loads(path.read_text()) == json.loads(json.dumps(report))
    assert report["ok"] and report["context"]["impl"] == "interpret"
    checks = report["kernel_checks"]
    assert {(r["case"], r["dtype"]) for r in checks} == {
        (case[0], dtype) for case in gpu_check.KERNEL_CASES for dtype in ("float32", "bfloat16")}
    assert all(r["ok"] and r["max_out_error"] <= r["tolerance"] for r in checks)
    tokens = report["tokens"]
    assert tokens["device_tokens"] == tokens["cpu_tokens"]
    assert [len(t) for t in tokens["cpu_tokens"]] == [4, 4, 4]
    assert any(name.startswith("prefill") for name in report["kernel_table"])
    assert any(name.startswith("decode") for name in report["kernel_table"])
    assert report["chunking_overhead"]["ratio"] > 0
    breakdown = report["decode_breakdown"]
    assert breakdown["device_ms"] > 0 and breakdown["attention_ms"] > 0
    assert breakdown["host_overhead_ms"] >= 0 and breakdown["layers"] == 2
    printed = capsys.readouterr().out
    assert "gpu-check: PASSED" in printed
    assert printed.rstrip().splitlines()[-1].startswith("decode ctx=128 batch=2")   # table last


def test_a_kernel_that_disagrees_with_the_oracle_fails_the_check(monkeypatch):
    # The check compares for real: a kernel off by 1e-3 fails at float32's tolerance.
    run = gpu_check.run_kernel_case
    monkeypatch.setattr(gpu_check, "run_kernel_case",
                        lambda *a: (lambda out, lse: (out + 1e-3, lse))(*run(*a)))
    monkeypatch.setattr(gpu_check, "KERNEL_CASES", gpu_check.KERNEL_CASES[1:2])
    plan = gpu_check.plan_for("cpu", True, 0)
    rows = gpu_check.check_kernels(plan, 0, "cpu", lambda msg: None)
    assert [(r["dtype"], r["ok"]) for r in rows] == [("float32", False), ("bfloat16", True)]


def test_a_part_that_raises_fails_the_run_but_not_the_parts_after_it(monkeypatch, tmp_path):
    # On a first device run each part's own result counts: the greedy-token check raising
    # must still leave the kernel table and the breakdown run, and the run FAILED.
    def broken(*args):
        raise RuntimeError("no such device")

    monkeypatch.setattr(gpu_check, "check_kernels", lambda *a: [{"case": "x", "dtype": "f",
                                                                 "ok": True}])
    monkeypatch.setattr(gpu_check, "check_tokens", broken)
    monkeypatch.setattr(gpu_check, "kernel_table", lambda *a: ({"row": {}}, None))
    monkeypatch.setattr(gpu_check, "decode_breakdown", lambda *a: None)
    path = tmp_path / "report.json"
    report = gpu_check.main(["--quick", "--seed", "1", "--json", str(path)])
    assert not report["ok"]
    assert report["errors"] == {"tokens": "RuntimeError: no such device"}
    assert report["kernel_table"] == {"row": {}}
    assert json.loads(path.read_text())["errors"] == report["errors"]


def test_a_kernel_case_that_raises_is_its_own_failed_row(monkeypatch):
    def run(case, impl, dtype, num_decodes, sm_scale):
        if num_decodes is None:
            raise ValueError("does not lower here")
        return run_case(case, impl, dtype, num_decodes, sm_scale)

    run_case = gpu_check.run_kernel_case
    monkeypatch.setattr(gpu_check, "run_kernel_case", run)
    monkeypatch.setattr(gpu_check, "KERNEL_CASES", gpu_check.KERNEL_CASES[1:])
    rows = gpu_check.check_kernels(gpu_check.plan_for("cpu", True, 0), 0, "cpu", lambda m: None)
    assert [(r["case"], r["ok"]) for r in rows] == [
        ("decode", True), ("mixed", True), ("decode_attention", False)] * 2
    assert rows[2]["error"] == "ValueError: does not lower here"


@pytest.mark.slow
def test_step_variants_run_the_breakdown_under_each_xla_flag_in_its_own_process():
    rows = gpu_check.step_variants(gpu_check.plan_for("cpu", True, 0), "cpu", 3, True,
                                   lambda msg: None)
    assert list(rows) == list(gpu_check.STEP_VARIANTS["cpu"])
    for name, row in rows.items():
        assert row["xla_flags"] == gpu_check.STEP_VARIANTS["cpu"][name]
        assert row["model"] == "tiny" and row["device_ms"] > 0 and row["dispatch_ms"] > 0


def test_the_split_sweep_times_each_count_and_compares_it_with_one_split(monkeypatch):
    plan = gpu_check.plan_for("cpu", True, 0)
    rows = gpu_check.split_sweep(plan, 5, lambda msg: None)
    assert [(r["context"], r["batch"]) for r in rows] == [
        (c, b) for c in plan.sweep_contexts for b in plan.sweep_batches]
    for row in rows:
        assert row["ok"] and set(row["time_ms"]) == set(plan.sweep_splits)
        assert row["max_diff_vs_1"][1] == 0 and row["best_splits"] in plan.sweep_splits
    # A kernel whose split path is off is caught: the sweep compares, not only times.
    real = gpu_check.ragged_paged_attention

    def off_when_split(*args, block_sizes, **kw):
        out, lse = real(*args, block_sizes=block_sizes, **kw)
        return (out + 0.01 if block_sizes.num_kv_splits > 1 else out), lse

    monkeypatch.setattr(gpu_check, "ragged_paged_attention", off_when_split)
    assert not any(row["ok"] for row in gpu_check.split_sweep(plan, 5, lambda msg: None))
