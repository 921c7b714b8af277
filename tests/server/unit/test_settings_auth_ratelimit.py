"""Pure units: settings precedence, API key matching, token buckets."""

from __future__ import annotations

import pytest
from sluice_server.core.auth.apikeys import KeyStore, authenticate, bearer, key_id
from sluice_server.core.auth.identity import Plan
from sluice_server.core.errors import ApiError
from sluice_server.core.limits.ratelimit import MemoryLimiter
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
    # a resumed stream lives in one process: several workers would lose reconnects
    with pytest.raises(Exception, match="needs --api-workers 1"):
        parse_settings(["--model", "m", "--api-workers", "2", "--resume-grace-seconds", "30"])
    assert parse_settings(["--model", "m", "--api-workers", "2"]).api_workers == 2


def test_vllm_args_from_settings():
    from sluice_server.engine.vllm_argv import vllm_cli_args

    s = parse_settings(["--model", "m", "--max-model-len", "512", "--swap-space", "2",
                        "--", "--seed", "3"])  # fmt: skip
    args = vllm_cli_args(s, "/models/m", cpu_defaults=True)
    assert args[:4] == ["--model", "/models/m", "--served-model-name", "m"]
    assert "--max-model-len" in args and "--kv-offloading-size" in args
    assert "--enforce-eager" in args and args[-2:] == ["--seed", "3"]
    assert "--otlp-traces-endpoint" not in args  # tracing off: vLLM's too


def test_tracing_endpoint_reaches_vllm():
    from sluice_server.engine.vllm_argv import vllm_cli_args

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
    assert ks.match("key-a").id == key_id("key-a") and ks.match("key-b").id == key_id("key-b")
    assert ks.match("key-") is None and ks.match("") is None and ks.match(None) is None
    assert bearer("Bearer key-a") == "key-a" and bearer("Basic key-a") is None
    assert authenticate(None, None).tenant == "anonymous"
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


async def test_requests_per_minute_bucket():
    clock = Clock()
    rl, plan = MemoryLimiter(clock=clock), Plan(rpm=3)
    for _ in range(3):
        await rl.admit("k", plan)
    with pytest.raises(ApiError) as e:
        await rl.admit("k", plan)
    assert e.value.status == 429 and e.value.headers["Retry-After"] == "20"
    await rl.admit("other", plan)  # per key
    clock.t += 20  # one request refilled (3 per 60 s)
    await rl.admit("k", plan)
    with pytest.raises(ApiError):
        await rl.admit("k", plan)


async def test_tokens_per_minute_bucket_goes_into_debt():
    clock = Clock()
    rl, plan = MemoryLimiter(clock=clock), Plan(tpm=600)  # 10 tokens/s
    await rl.admit("k", plan)
    await rl.charge("k", plan, 650)  # 50 in debt
    with pytest.raises(ApiError) as e:
        await rl.admit("k", plan)
    assert e.value.headers["Retry-After"] == "6"  # (50 + 1) / 10 -> 5.1 s -> 6
    clock.t += 6
    await rl.admit("k", plan)


async def test_a_changed_plan_resizes_the_bucket():
    clock = Clock()
    rl = MemoryLimiter(clock=clock)
    await rl.admit("k", Plan(rpm=60))
    await rl.admit("k", Plan(rpm=1))  # the new, smaller plan caps the level at 1: 0 left
    with pytest.raises(ApiError):
        await rl.admit("k", Plan(rpm=1))


def test_key_file_plans_and_tenants():
    text = """# plans
sk-plain
sk-acme-1  tenant=acme  rpm=600  tpm=200000   # a comment after the fields
sk-free    tenant=free  rpm=10
sk-unlimited tenant=acme rpm=0 tpm=0
"""
    ks = KeyStore.parse(text, Plan(rpm=60, tpm=1000))
    plain, acme, free, unlimited = (ks.match(k) for k in
                                    ("sk-plain", "sk-acme-1", "sk-free", "sk-unlimited"))  # fmt: skip
    assert (plain.tenant, plain.plan) == ("default", Plan(60, 1000))
    assert (acme.tenant, acme.plan) == ("acme", Plan(600, 200000))
    assert (free.tenant, free.plan) == ("free", Plan(10, 1000))
    assert not unlimited.plan.enabled and unlimited.id != acme.id
    assert ks.tenants == {"default", "acme", "free"} and len(ks) == 4
    assert plain.models is None  # every served name


def test_a_key_may_be_limited_to_served_names():
    ks = KeyStore.parse("sk-a tenant=acme models=support-v2,qwen/base rpm=5\nsk-b\n")
    a = ks.match("sk-a")
    assert (a.tenant, a.plan.rpm, a.models) == ("acme", 5, {"support-v2", "qwen/base"})
    assert ks.match("sk-b").models is None


@pytest.mark.parametrize("text, says", [
    ("sk-secret-1 rpm=ten\n", "line 1: rpm must be a whole number"),
    ("# c\nsk-secret-1 tier=gold\n", "line 2: expected `KEY [tenant=NAME]"),
    ("sk-secret-1 rpm=1 rpm=2\n", "line 1: expected"),
    ("sk-secret-1 tenant=a/b\n", "line 1: tenant must match"),
    ("sk-secret-1\nsk-secret-1 tenant=x\n", "line 2: the same key appears twice"),
    ("sk-secret-1 models=\n", "line 1: models must be served names"),
    ("sk-secret-1 models=a,b c\n", "line 1: expected"),
    ("sk-secret-1 models=a b\n", "line 1: expected"),
    ("sk-secret-1 models=a models=b\n", "line 1: expected"),
    ("# only comments\n\n", "holds no keys"),
])  # fmt: skip
def test_bad_key_files_say_where_but_not_what(text, says):
    with pytest.raises(ValueError) as e:
        KeyStore.parse(text)
    assert says in str(e.value) and "sk-secret" not in str(e.value)


def test_credentials_are_redacted_from_log_lines():
    from sluice_server.transport.redact import redact

    line = '127.0.0.1:5 - "WebSocket /ws/stream?model=m&api_key=sk-secret-1&x=2" 401'
    assert redact(line) == '127.0.0.1:5 - "WebSocket /ws/stream?model=m&api_key=[redacted]&x=2" 401'
    assert redact("< authorization: Bearer eyJa.b.c") == "< authorization: [redacted]"
    assert redact("< X-API-Key: sk-secret-1") == "< X-API-Key: [redacted]"
    assert redact("GET /v1/stream?access_token=eyJa.b.c HTTP/1.1") == (
        "GET /v1/stream?access_token=[redacted] HTTP/1.1"
    )
    assert redact("nothing to see") == "nothing to see"
