"""Pure units: settings precedence, API key matching, token buckets."""

from __future__ import annotations

import pytest
from sluice_server.core.auth import KeyStore, authenticate, bearer, key_id
from sluice_server.core.errors import ApiError
from sluice_server.core.ratelimit import RateLimiter
from sluice_server.settings import parse_settings


def test_flags_win_over_env(monkeypatch):
    monkeypatch.setenv("SLUICE_PORT", "9100")
    monkeypatch.setenv("SLUICE_RATE_LIMIT_RPM", "60")
    monkeypatch.setenv("SLUICE_PROTOCOLS", "sse")
    s = parse_settings(["--model", "tiny", "--port", "9200"])
    assert s.port == 9200 and s.rate_limit_rpm == 60 and s.protocols == ["sse"]


def test_every_documented_flag_parses():
    argv = ["--model", "org/m", "--revision", "abc", "--served-model-name", "chat",
            "--host", "127.0.0.1", "--port", "8001", "--engine", "simulator",
            "--tensor-parallel-size", "2", "--pipeline-parallel-size", "1",
            "--gpu-memory-utilization", "0.8", "--max-model-len", "4096",
            "--max-num-seqs", "64", "--max-num-batched-tokens", "8192", "--swap-space", "4",
            "--dtype", "bfloat16", "--quantization", "awq", "--protocols", "sse,websocket",
            "--heartbeat-seconds", "5", "--max-concurrent-streams", "10",
            "--stream-timeout-seconds", "30", "--api-key-file", "/keys",
            "--rate-limit-rpm", "5", "--rate-limit-tpm", "500", "--drain-timeout-seconds", "9",
            "--sim-ttft-ms", "10", "--sim-itl-ms", "2", "--sim-ttft-per-stream-ms", "1",
            "--sim-jitter", "0.1", "--", "--enforce-eager", "--kv-cache-memory-bytes", "1"]  # fmt: skip
    s = parse_settings(argv)
    assert s.engine == "simulator" and s.tensor_parallel_size == 2
    assert s.model_label == "chat" and s.swap_space == 4.0
    assert s.engine_args == ["--enforce-eager", "--kv-cache-memory-bytes", "1"]
    assert str(s.api_key_file) == "/keys" and s.protocols == ["sse", "websocket"]


def test_bad_flags_are_rejected():
    with pytest.raises(Exception, match="protocols"):
        parse_settings(["--model", "m", "--protocols", "sse,grpc"])
    with pytest.raises(Exception, match="max_concurrent_streams"):
        parse_settings(["--model", "m", "--max-concurrent-streams", "0"])


def test_vllm_args_from_settings():
    from sluice_server.engine.vllm_engine import vllm_cli_args

    s = parse_settings(["--model", "m", "--max-model-len", "512", "--swap-space", "2",
                        "--", "--seed", "3"])  # fmt: skip
    args = vllm_cli_args(s, "/models/m", cpu_defaults=True)
    assert args[:4] == ["--model", "/models/m", "--served-model-name", "m"]
    assert "--max-model-len" in args and "--kv-offloading-size" in args
    assert "--enforce-eager" in args and args[-2:] == ["--seed", "3"]
    assert "--otlp-traces-endpoint" not in args  # tracing off: vLLM's too


def test_tracing_endpoint_reaches_vllm():
    from sluice_server.engine.vllm_engine import vllm_cli_args

    url = "http://collector:4318/v1/traces"
    s = parse_settings(["--model", "m", "--otlp-traces-endpoint", url,
                        "--trace-sample-ratio", "0.25", "--access-log-format", "json"])  # fmt: skip
    args = vllm_cli_args(s, "/models/m", cpu_defaults=False)
    assert args[args.index("--otlp-traces-endpoint") + 1] == url
    assert s.trace_sample_ratio == 0.25 and s.access_log_format == "json"
    with pytest.raises(Exception, match="trace_sample_ratio"):
        parse_settings(["--model", "m", "--trace-sample-ratio", "2"])
    with pytest.raises(Exception, match="access_log_format"):
        parse_settings(["--model", "m", "--access-log-format", "xml"])


def test_key_file_and_constant_time_match(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# comment\n\nkey-a\n  key-b \n")
    ks = KeyStore.from_file(f)
    assert ks.match("key-a") == key_id("key-a") and ks.match("key-b") == key_id("key-b")
    assert ks.match("key-") is None and ks.match("") is None and ks.match(None) is None
    assert bearer("Bearer key-a") == "key-a" and bearer("Basic key-a") is None
    assert authenticate(None, None) == "anonymous"
    with pytest.raises(ApiError) as e:
        authenticate(ks, "wrong")
    assert e.value.status == 401 and "wrong" not in e.value.message
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ValueError):
        KeyStore.from_file(tmp_path / "empty")


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_requests_per_minute_bucket():
    clock = Clock()
    rl = RateLimiter(rpm=3, tpm=0, clock=clock)
    for _ in range(3):
        rl.admit("k")
    with pytest.raises(ApiError) as e:
        rl.admit("k")
    assert e.value.status == 429 and e.value.headers["Retry-After"] == "20"
    rl.admit("other")  # per key
    clock.t += 20  # one request refilled (3 per 60 s)
    rl.admit("k")
    with pytest.raises(ApiError):
        rl.admit("k")


def test_tokens_per_minute_bucket_goes_into_debt():
    clock = Clock()
    rl = RateLimiter(rpm=0, tpm=600, clock=clock)  # 10 tokens/s
    rl.admit("k")
    rl.charge_tokens("k", 650)  # 50 in debt
    with pytest.raises(ApiError) as e:
        rl.admit("k")
    assert e.value.headers["Retry-After"] == "6"  # (50 + 1) / 10 -> 5.1 s -> 6
    clock.t += 6
    rl.admit("k")
