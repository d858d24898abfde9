"""The `medha-jax` command: generate (text in, text out), serve (a real gRPC server process
with a token, stopped by SIGTERM), and errors that name the bad value."""

import json
import re
import signal
import subprocess
import sys

import grpc
import pytest

from medha_jax import load_model
from medha_jax.config import model_preset
from serving.cli import main
from tests.hf_oracle import greedy_with_logits
from tests.test_checkpoint_hf import hf_config_dict, random_state_dict, write_hf_dir
from tests.test_server import byte_level_tokenizer

# One token rung (16), as in tests/test_server.py: the default ladder from 1 token is 5
# rungs, each compiled in every process these tests start.
SMALL_ENGINE = ["--max-model-len", "256", "--max-tokens-per-step", "16",
                "--min-token-bucket", "16", "--max-seqs", "8", "--max-kv-tokens", "2048"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random checkpoint directory with a byte-level tokenizer, as a user would pass."""
    path = tmp_path_factory.mktemp("tiny-with-tokenizer")
    config = model_preset("tiny")
    write_hf_dir(path, hf_config_dict(config), random_state_dict(config, seed=5))
    byte_level_tokenizer().backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({}))
    return str(path)


def test_generate_prints_the_greedy_text(model_dir, capsys):
    prompt = "héllo"
    assert main(["generate", prompt, "--model", model_dir, "--max-tokens", "4",
                 *SMALL_ENGINE]) == 0
    out, err = capsys.readouterr()
    model = load_model(model_dir)
    expected = greedy_with_logits(model, model.tokenizer.encode(prompt), 4)
    assert out == model.tokenizer.decode(expected) + "\n"
    assert "4 tokens, finish_reason=length" in err


@pytest.mark.parametrize("argv, message", [
    (["generate", ""], "prompt is empty"),
    (["generate", "hi", "--max-tokens", "0"], "max_tokens must be an int >= 1"),
    (["generate", "hi", "--temperature", "-1"], "temperature must be >= 0"),
    (["generate", "hi", "--policy", "fifo"], "unknown policy 'fifo'"),
    (["generate", "hi", "--target-batch-time", "0"], "target_batch_time_s must be > 0"),
    (["generate", "hi", "--prefill-hold", "-1"], "prefill_hold_s must be a finite number"),
    (["serve", "--router", "random"], "unknown routing policy 'random'"),
    (["serve", "--replicas", "0"], "--replicas must be >= 1, got 0"),
    (["serve", "--replicas", "2", "--roles", "x:2"], "unknown role 'x'"),
    (["serve", "--replicas", "2", "--roles", "prefill:1,decode:2"], "roles name 3 replicas"),
    (["serve", "--replicas", "2", "--offload", "sometimes"], "unknown gate 'sometimes'"),
    (["serve", "--replicas", "2", "--offload", "time+later"], "a gate then +move"),
    (["serve", "--replicas", "2", "--offload", "time+move"], "Ray replica actors only (add --ray)"),
    (["serve", "--decode-delay-weight", "-1"], "decode_delay_weight must be >= 0"),
    (["serve", "--replicas", "3", "--parallel", "tp=2/tp=1"],
     "--parallel names 2 replica meshes but --replicas is 3"),
    (["serve", "--replicas", "2", "--parallel", "tp=2/tp=1", "--ray"],
     "not supported with --ray yet"),
    (["serve", "--dp", "2"], "--dp N and --switching POLICY go together"),
    (["serve", "--prefill-pool", "3"], "PrefillPoolConfig.devices must be a power of two"),
    (["serve", "--prefill-pool", "2", "--ray"], "--prefill-pool does not combine with --ray"),
    (["serve", "--prefill-pool", "2", "--prefill-pool-improvement-rate", "1"],
     "improvement_rate must be in"),
    (["serve", "--dp", "2", "--switching", "load", "--parallel", "kvp=2"],
     "switching's base replicas are one device or a TP group"),
    (["serve", "--replicas", "2", "--cpu-bind", "auto"], "--cpu-bind binds Ray replica actors"),
    (["serve", "--replicas", "2", "--cpu-bind", "0-1", "--ray"],
     "one non-empty set of CPU numbers per replica (2)"),
    (["serve", "--replicas", "2", "--cpu-bind", "0|a", "--ray"], "'a' is not a CPU list"),
])
def test_errors_name_the_value(model_dir, capsys, argv, message):
    assert main([*argv, "--model", model_dir, *SMALL_ENGINE]) == 2
    assert message in capsys.readouterr().err


def test_serve_hands_the_router_its_decode_weight_and_ttft_floor(model_dir, monkeypatch):
    import serving.server
    from medha_jax.cluster.router import RoutingConfig
    from serving.cli import _make_server, build_parser

    seen = {}
    monkeypatch.setattr(serving.server, "Server", lambda *args, **kwargs: seen.update(kwargs))
    args = build_parser().parse_args(["serve", "--replicas", "2", "--decode-delay-weight", "1",
                                      "--ttft-floor", "--model", model_dir, *SMALL_ENGINE])
    _make_server(args, warmup=False, calibrate=False)
    assert seen["router"] == RoutingConfig(decode_delay_weight=1.0, ttft_floor=True)
    args = build_parser().parse_args(["serve", "--replicas", "2", "--model", model_dir])
    _make_server(args, warmup=False, calibrate=False)
    assert seen["router"] == RoutingConfig()


def test_unknown_model_is_named(capsys):
    assert main(["generate", "hi", "--model", "no-such-model"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err


@pytest.mark.slow
def test_serve_answers_grpc_with_the_token_and_stops_on_sigterm(model_dir):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from serving.proto import medha_pb2, medha_pb2_grpc

    proc = subprocess.Popen(
        [sys.executable, "-m", "serving.cli", "serve", "--model", model_dir, "--port", "0",
         "--token", "tok", *SMALL_ENGINE], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        banner = ""
        for line in proc.stdout:                  # blocks until the server is up
            if line.startswith("serving "):
                banner = line
                break
        match = re.search(r" on (127\.0\.0\.1:\d+) \(bearer token required\)", banner)
        assert match, f"no banner; stderr: {proc.stderr.read() if proc.poll() is not None else ''}"
        with grpc.insecure_channel(match.group(1)) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=30).status == \
                health_pb2.HealthCheckResponse.SERVING
            stub = medha_pb2_grpc.MedhaStub(channel)
            request = medha_pb2.GenerateRequest(
                text="hi", sampling=medha_pb2.SamplingParams(temperature=0.0, max_tokens=3))
            responses = list(stub.Generate(request, metadata=(("authorization", "Bearer tok"),),
                                           timeout=60))
            assert responses[-1].finished and responses[-1].finish_reason == "length"
            assert sum(len(r.token_ids) for r in responses) == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("argv, want", [
    (["serve", "--hosts", "2", "--ray", "--port", "0"], ["serve", "--hosts", "2", "--port", "0"]),
    (["serve", "--ray", "head:6379", "--hosts", "2"], ["serve", "--hosts", "2"]),
    (["serve", "--hosts", "2", "--ray=ray://head:10001"], ["serve", "--hosts", "2"]),
    (["serve", "--hosts", "2", "--ray"], ["serve", "--hosts", "2"]),
    (["serve", "--ray-host-resources", '{"TPU": 4}', "--ray"],
     ["serve", "--ray-host-resources", '{"TPU": 4}']),
])
def test_each_hosts_process_runs_the_command_without_ray(argv, want):
    """What a Ray host actor runs (serving.ray_hosts): the same serve command, without
    --ray [ADDRESS], however it was written."""
    from serving.ray_hosts import without_ray_flag

    assert without_ray_flag(argv) == want
