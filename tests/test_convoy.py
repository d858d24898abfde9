"""The convoy experiment, simulated: LARS cures the convoy that non-preemptive FCFS builds."""

import json

import pytest

from benchmarks import convoy


def test_lars_cures_the_convoy_on_16_a100s(tmp_path):
    # Seed 000, figure 1 / section 6.2: Llama-3 8B on 16 A100s (TP-8, SPP-2), ShareGPT4-like
    # traffic with 5% Medha-SWE long requests (128K-1M tokens) at 0.75 QPS. 300 requests
    # (15 long) keep the test short; `python -m benchmarks.convoy` runs 1000.
    out_dir, json_path = tmp_path / "figures", tmp_path / "convoy.json"
    report = convoy.main([
        "--simulate", "--model", "llama3-8b", "--hardware", "a100", "--gpus", "16",
        "--parallel", "tp=8,spp=2", "--long-fraction", "0.05", "--qps", "0.75",
        "--requests", "300", "--seed", "0", "--policies", "fcfs-np,lars",
        "--out", str(out_dir), "--json", str(json_path), "--no-progress"])
    fcfs, lars = (report["results"]["0.75"][p] for p in ("fcfs-np", "lars"))
    assert lars["short_ttft_p50"] * 10 <= fcfs["short_ttft_p50"]
    assert lars["short_ttft_p99"] * 10 <= fcfs["short_ttft_p99"]
    for summary in (fcfs, lars):
        assert summary["long_total"] == 15
        assert summary["long_completed"] == summary["long_total"]
        assert summary["num_completed"] == summary["num_requests"] == 300

    written = json.loads(json_path.read_text())
    assert written["results"]["0.75"]["lars"] == pytest.approx(lars)
    context = written["context"]
    assert context["mode"] == "simulated" and context["replicas"] == 1
    assert context["hardware"] == "a100" and "AnalyticalPredictor" in context["predictor"]
    for key in ("backend", "device_count", "jax", "jaxlib", "date", "workload"):
        assert key in context
    assert {p.name for p in out_dir.iterdir()} == {
        "ttft_cdf_short.png", "ttft_cdf_long.png", "ttft_over_time_qps0.75.png"}
    assert all(p.stat().st_size > 10_000 for p in out_dir.iterdir())


def test_arguments_validate_and_default_by_mode():
    args = convoy.parse_args(["--quick"])
    assert args.mode == "simulate" and args.model == "llama3-8b" and args.qps == (0.75,)
    assert args.policies == ("fcfs-np", "lars", "lars-mp")
    args = convoy.parse_args(["--server", "--qps", "0.5,1"])
    assert args.mode == "server" and args.model == "smollm2-135m" and args.qps == (0.5, 1.0)
    assert args.policies == ("lars-mp", "lars", "fcfs-np") and args.requests == 40
    assert convoy.server_engine_config(args)["max_model_len"] == args.max_model_len == 8192
    args = convoy.parse_args(["--server", "--long-scale", "0.005", "--max-model-len", "4096"])
    assert convoy.workload(args, 0.5, max_prompt_tokens=4032) != convoy.workload(
        convoy.parse_args(["--server"]), 0.5, max_prompt_tokens=4032)
    assert convoy.server_engine_config(args)["max_kv_tokens"] >= 4 * 4096
    with pytest.raises(SystemExit):
        convoy.parse_args(["--server", "--long-scale", "0"])
    args = convoy.parse_args(["--validate-simulator"])
    assert args.mode == "validate" and args.policies == ("lars-mp", "lars", "fcfs-np")
    assert args.requests == 80
    args = convoy.parse_args(["--figure13"])
    assert args.policies == ("fcfs", "edf", "lrs", "lars", "lars-mp")
    assert args.out == "results/figure13"
    with pytest.raises(SystemExit):
        convoy.parse_args(["--server", "--figure13"])
    with pytest.raises(SystemExit):
        convoy.parse_args(["--policies", "lars,sjf"])
    with pytest.raises(SystemExit):
        convoy.parse_args(["--server", "--simulate"])


@pytest.mark.slow
def test_figure13_loads_bracket_long_saturation(tmp_path):
    # Three loads around the QPS where long prefills alone fill the replica; the full
    # scheduler (lars-mp) against vanilla LARS at each (issue 18, seed 000 figure 13).
    # The other ablation policies run in `--figure13`; here they would only cost time, as
    # would more requests (100, 5 long: the claims below hold with the margins noted).
    report = convoy.main(["--simulate", "--figure13", "--requests", "100", "--seed", "1",
                          "--policies", "lars,lars-mp", "--out", str(tmp_path),
                          "--no-progress"])
    figure13 = report["context"]["figure13"]
    by_load = {v["long_load"]: report["results"][qps]
               for qps, v in figure13["loads"]["by_qps"].items()}
    assert sorted(by_load) == pytest.approx([0.5, 0.9, 1.3], rel=1e-3)   # QPS to 4 digits
    assert set(report["results"]) == set(figure13["ttft_over_deadline"])
    deadline = convoy.SLOPolicy().short_ttft_s
    below, near, above = (by_load[load] for load in sorted(by_load))
    for runs in (below, near, above):
        full, lars = runs["lars-mp"], runs["lars"]
        # Short requests start well inside their deadline, not at it, at every load.
        assert full["short_ttft_p50"] < 0.1 * deadline
        assert full["short_ttft_p90"] < 0.25 * deadline
        for summary in runs.values():
            assert summary["long_completed"] == summary["long_total"] > 0
    # Below saturation, the median short request at least 1.6x sooner than under LARS
    # (seed 000: 1.6-1.8x) where there is a convoy to cure: at 0.9 of saturation LARS
    # holds the median short request to its deadline (18x here). At 0.5 more than half
    # of the short requests arrive while no long prefill runs, and both serve those at
    # once: the medians are close (LARS 0.107 vs 0.103 s here, 0.087 vs 0.076 s with 200
    # requests, 0.084 vs 0.080 s with 1000), so there the gain shows at p90 (2.1 vs
    # 0.14 s).
    assert near["lars-mp"]["short_ttft_p50"] * 1.6 <= near["lars"]["short_ttft_p50"]
    assert below["lars-mp"]["short_ttft_p50"] <= below["lars"]["short_ttft_p50"]
    assert below["lars-mp"]["short_ttft_p90"] * 1.6 <= below["lars"]["short_ttft_p90"]
    assert (tmp_path / "figure13_ttft_over_deadline.png").stat().st_size > 10_000


def test_gpus_must_split_into_replicas():
    with pytest.raises(SystemExit, match="multiple"):
        convoy.main(["--simulate", "--gpus", "12", "--parallel", "tp=8", "--requests", "10",
                     "--no-progress"])


class _Biased:
    """A device `bias` times slower than the predictor it wraps (the simulated clock only)."""

    def __init__(self, predictor, bias):
        self.predictor, self.bias = predictor, bias

    def predict(self, batch):
        return self.bias * self.predictor.predict(batch)

    def predict_features(self, features):
        return self.bias * self.predictor.predict_features(features)


def _percentile_ratios(requests, name):
    """Simulated over measured TTFT / TPOT p50 and p90, computed here from the per-request
    figures (not with the report's own code); |ratio - 1| is the report's relative error."""
    import numpy as np

    ratios = {}
    for metric in ("ttft", "tpot"):
        measured = [r[f"measured_{metric}_s"] for r in requests
                    if r[f"measured_{metric}_s"] is not None]
        simulated = [r[f"simulated_{name}_{metric}_s"] for r in requests
                     if r[f"simulated_{name}_{metric}_s"] is not None]
        for q in (50, 90):
            ratios[f"{metric}_p{q}"] = np.percentile(simulated, q) / np.percentile(measured, q)
    return ratios


# The bound the tiny honest run must meet, as simulated / measured percentiles. One-sided
# where it can be tight: the live run also pays what the simulator does not model (the
# server's host work and hand-offs per request, as long as a ~1 ms step of this model, and
# the stalls of a shared 2-core CPU), so it only ever runs slower than its simulation: in
# 15 hand runs at load averages 6-17 the ratios were 0.05-1.00, the medians' 0.31-1.00,
# none above 1 - the 25% cannot hold here. A simulated device slower than the
# live engine is never right, so no percentile may exceed 1.2x the measured one, and a
# loose floor on the medians still catches a device far too fast. A device 1.5x too slow
# fails this bound when the run's TPOT p50 is within 20%: checked by hand, in 5 of 6 runs
# at load averages 6-9 (its ratios 1.26-1.50), but not at 14-17, where the live run
# itself was 1.5-3x slower than its simulation - hence the test's twin is 3x slow.
HONEST_MAX_RATIO, HONEST_MIN_P50_RATIO = 1.2, 0.2
BIASED_DEVICE = 3.0


@pytest.mark.slow
def test_simulator_validation_detects_a_biased_device(tmp_path, monkeypatch):
    # The --validate-simulator path end to end on a tiny engine (one compiled shape). The
    # report's errors are checked against percentiles computed here from its per-request
    # figures; the honest twin against HONEST_MAX_RATIO and HONEST_MIN_P50_RATIO (not the
    # 25% bar, which applies to the CPU-sized model of `--validate-simulator`, whose steps
    # take 100s of ms); and a deliberately biased simulated device (BIASED_DEVICE x slower
    # than this run's iterations), simulated beside the honest one on the same live run,
    # must give longer latencies at every percentile and fail both the bound and the bar.
    monkeypatch.setattr(convoy, "SERVER_ENGINE", dict(
        page_size=16, max_kv_tokens=2048, max_model_len=256, max_tokens_per_step=64,
        min_token_bucket=64, max_seqs=8, enable_prefix_caching=False))
    monkeypatch.setattr(convoy, "SERVER_SCALES", dict(
        short_scale=0.02, long_scale=2e-4, output_scale=0.01, max_output_tokens=6))
    check_simulator, simulate_policy, biased = convoy.check_simulator, convoy.simulate_policy, {}

    def with_a_biased_twin(server, predictor, trace, **kwargs):
        def slower(*args, device_predictor=None, **kw):
            return simulate_policy(*args, device_predictor=_Biased(device_predictor,
                                                                   BIASED_DEVICE), **kw)

        monkeypatch.setattr(convoy, "simulate_policy", slower)
        biased["check"], _ = check_simulator(server, predictor, trace, **kwargs)
        monkeypatch.setattr(convoy, "simulate_policy", simulate_policy)
        return check_simulator(server, predictor, trace, **kwargs)

    monkeypatch.setattr(convoy, "check_simulator", with_a_biased_twin)
    report = convoy.main(["--validate-simulator", "--model", "tiny", "--policies", "lars",
                          "--requests", "12", "--qps", "8", "--long-fraction", "0.2",
                          "--json", str(tmp_path / "v.json"), "--no-progress"])
    runs = report["results"]["8"]
    assert set(runs) == {"lars", "lars (simulated, as calibrated)", "lars (simulated, as run)"}
    for summary in runs.values():
        assert summary["num_completed"] == summary["num_requests"] == 12
        assert summary["long_completed"] == summary["long_total"] == 2
    honest, slow = report["validation"]["8"]["lars"], biased["check"]
    assert len(honest["requests"]) == 12 and honest["calibration_error_on_run_steps"]["steps"] > 0
    ratios = _percentile_ratios(honest["requests"], "as_run")
    slow_ratios = _percentile_ratios(slow["requests"], "as_run")
    for key, ratio in ratios.items():
        assert honest["as run"][key]["rel_error"] == pytest.approx(abs(ratio - 1))
        assert slow["as run"][key]["rel_error"] == pytest.approx(abs(slow_ratios[key] - 1))
        assert ratio < slow_ratios[key]           # a slower device: longer latencies
        assert ratio <= HONEST_MAX_RATIO
        if key.endswith("p50"):
            assert ratio >= HONEST_MIN_P50_RATIO
    assert max(slow_ratios.values()) > HONEST_MAX_RATIO and not slow["within_tolerance"]
    assert honest["within_tolerance"] == (max(abs(r - 1) for r in ratios.values()) <= 0.25)
    assert json.loads((tmp_path / "v.json").read_text())["context"]["mode"] == \
        "live server + simulator"
