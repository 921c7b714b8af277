"""Who may call and how much, over the simulator engine (seconds, no vLLM): per-key plans and
tenants from the key file, Bearer JWTs, metrics and logs by tenant, and no key or token in
any server log line."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
import pytest_asyncio
from conftest import serve_simulator
from sluice_server.core.auth import key_id
from sluice_server.engine.simulator import SimulatorEngine

pytestmark = pytest.mark.asyncio(loop_scope="session")

ACME, FREE, PLAIN = "sk-acme-0123456789", "sk-free-9876543210", "sk-plain-5555555555"
KEY_FILE = f"""# mounted from a Secret
{ACME}  tenant=acme  rpm=1
{FREE}  tenant=free  rpm=3
{PLAIN}
"""
# The client libraries log what they send; the server must not.
CLIENT_LOGGERS = ("httpx", "httpcore", "websockets.client", "openai")


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest_asyncio.fixture(loop_scope="session")
async def sim():
    engine = SimulatorEngine(model_name="sim", ttft_ms=0, itl_ms=0)
    yield engine
    await engine.shutdown()


async def stream(c: httpx.AsyncClient, key: str | None, **params) -> httpx.Response:
    headers = auth(key) if key else {}
    return await c.post("/v1/stream", json={"prompt": "a b", "max_tokens": 3, **params},
                        headers=headers)  # fmt: skip


def server_log_lines(caplog, capfd) -> list[str]:
    """Every server-side log line: our records (caplog) and what uvicorn's own handlers
    wrote (they do not propagate to the root logger; capfd reads their stream)."""
    lines = [r.getMessage() for r in caplog.records if not r.name.startswith(CLIENT_LOGGERS)]
    lines += capfd.readouterr().err.splitlines()
    assert lines, "expected some server-side log records at DEBUG"
    return lines


async def test_each_key_has_its_plan_and_metrics_name_tenants(sim, tmp_path, caplog, capfd):
    keys = tmp_path / "api-keys"
    keys.write_text(KEY_FILE)
    caplog.set_level(logging.DEBUG)
    async with serve_simulator(sim, api_key_file=keys, rate_limit_rpm=2,
                               log_level="debug") as url:  # fmt: skip
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            assert [(await stream(c, ACME)).status_code for _ in range(2)] == [200, 429]
            assert [(await stream(c, FREE)).status_code for _ in range(4)] == [200] * 3 + [429]
            # no plan in the file: the flags' plan (2 per minute), tenant "default"
            assert [(await stream(c, PLAIN)).status_code for _ in range(3)] == [200, 200, 429]
            assert (await stream(c, "sk-wrong")).status_code == 401
            metrics = (await c.get("/metrics")).text

    def value(name: str, **labels) -> float:
        want = ",".join(f'{k}="{v}"' for k, v in sorted({"model": "sim", **labels}.items()))
        for line in metrics.splitlines():
            if line.startswith(f"{name}{{{want}}} "):
                return float(line.split()[-1])
        raise AssertionError(f"{name}{{{want}}} not in /metrics")

    assert value("sluice_tenant_requests_total", tenant="acme", result="admitted") == 1
    assert value("sluice_tenant_requests_total", tenant="acme", result="rate_limit") == 1
    assert value("sluice_tenant_requests_total", tenant="free", result="admitted") == 3
    assert value("sluice_tenant_requests_total", tenant="default", result="rate_limit") == 1
    assert value("sluice_tenant_tokens_total", tenant="free") == 3 * (2 + 3)
    for key in (ACME, FREE, PLAIN):  # metrics by tenant, never by key (nor its hash)
        assert key not in metrics and key_id(key) not in metrics

    lines = server_log_lines(caplog, capfd)
    assert any("tenant=acme" in ln and "rate_limit" in ln for ln in lines), lines
    assert not [ln for ln in lines for k in (ACME, FREE, PLAIN, "sk-wrong") if k in ln]


async def test_jwt_bearer_only_the_valid_token_is_admitted(sim, tmp_path, caplog, capfd):
    import websockets
    from app_helpers import ws_url
    from jwt_helpers import AUDIENCE, ISSUER, Issuer, bad_tokens, jwks

    issuer = Issuer("rsa-1")
    (tmp_path / "jwks.json").write_text(json.dumps(jwks(issuer)))
    keys = tmp_path / "api-keys"
    keys.write_text(KEY_FILE)
    good = issuer.token(tenant="webapp", rpm=2)
    fresh = issuer.token(tenant="webapp", sub="user-ws")
    bad = bad_tokens(issuer)
    settings = dict(api_key_file=keys, jwt_jwks_file=tmp_path / "jwks.json", jwt_issuer=ISSUER,
                    jwt_audience=AUDIENCE, log_level="debug")  # fmt: skip
    caplog.set_level(logging.DEBUG)
    async with serve_simulator(sim, **settings) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            for name, token in bad.items():
                r = await stream(c, token)
                assert r.status_code == 401, (name, r.text)
                assert r.json()["error"]["code"] == "invalid_token", name
            assert (await stream(c, good)).status_code == 200
            r = await c.post("/v1/chat/completions", headers=auth(good), json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})  # fmt: skip
            assert r.status_code == 200
            assert (await stream(c, good)).status_code == 429  # the token's rpm=2
            assert (await stream(c, FREE)).status_code == 200  # keys still work
            # A browser's WebSocket carries the short-lived token in the query.
            async with websockets.connect(ws_url(url) + f"?api_key={fresh}") as ws:
                await ws.send(json.dumps({"id": 1, "prompt": "a",
                                          "params": {"max_tokens": 1}}))  # fmt: skip
                while not json.loads(await asyncio.wait_for(ws.recv(), 10)).get("finished"):
                    pass
            for token in (bad["expired"], bad["alg none"]):
                with pytest.raises(websockets.InvalidStatus) as info:
                    async with websockets.connect(ws_url(url) + f"?api_key={token}"):
                        pass
                assert info.value.response.status_code == 401
            metrics = (await c.get("/metrics")).text
    assert 'result="admitted",tenant="webapp"} 3.0' in metrics
    secrets = [good, fresh, ACME, FREE, PLAIN, *bad.values()]
    secrets += [t.rsplit(".", 1)[-1] for t in secrets if t.count(".") == 2]  # signatures
    lines = server_log_lines(caplog, capfd)
    assert any('"WebSocket /ws/stream?api_key=[redacted]" 401' in ln for ln in lines), lines
    assert not [ln for ln in lines for t in secrets if t and t in ln]
