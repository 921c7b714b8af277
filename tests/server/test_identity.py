"""Who may call and how much, over the simulator engine (seconds, no vLLM): per-key plans and
tenants from the key file, Bearer JWTs, metrics and logs by tenant, no key or token in any
server log line, and both files rotated the way kubelet rotates a mounted Secret."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil

import httpx
import pytest
import pytest_asyncio
import websockets
from app_helpers import error_of, serve_simulator, sse_events, token_payloads, ws_url
from sluice_server.core.auth.apikeys import key_id
from sluice_server.engine.simulator import SimulatorEngine
from testkit.wait import eventually_async

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
            # A socket outlives its token: past `exp` (and the 30 s leeway) it starts no more.
            ending = issuer.token(ttl=-28.5, tenant="webapp", sub="user-ws")
            async with websockets.connect(ws_url(url) + f"?api_key={ending}") as ws:
                await ws_generate(ws, "while valid")
                while not json.loads(await asyncio.wait_for(ws.recv(), 10)).get("finished"):
                    pass
                await asyncio.sleep(2.0)
                await ws_generate(ws, "expired")
                refused = json.loads(await asyncio.wait_for(ws.recv(), 10))
                assert refused.get("type") == "error", refused
                assert refused["error"]["code"] == "invalid_token", refused
            for token in (bad["expired"], bad["alg none"]):
                with pytest.raises(websockets.InvalidStatus) as info:
                    async with websockets.connect(ws_url(url) + f"?api_key={token}"):
                        pass
                assert info.value.response.status_code == 401
            metrics = (await c.get("/metrics")).text
    assert 'result="admitted",tenant="webapp"} 4.0' in metrics
    secrets = [good, fresh, ACME, FREE, PLAIN, *bad.values()]
    secrets += [t.rsplit(".", 1)[-1] for t in secrets if t.count(".") == 2]  # signatures
    lines = server_log_lines(caplog, capfd)
    assert any('"WebSocket /ws/stream?api_key=[redacted]" 401' in ln for ln in lines), lines
    assert not [ln for ln in lines for t in secrets if t and t in ln]


class MountedSecret:
    """A folder updated the way kubelet updates a mounted Secret: each version is a new
    `..<timestamp>` directory, `..data` points at it (swapped by one rename), each file
    name is a symlink through `..data`, and the old version is removed."""

    def __init__(self, root) -> None:
        self.root, self.version, self.current = root, 0, None
        root.mkdir()

    def write(self, files: dict[str, str]) -> None:
        self.version += 1
        new = self.root / f"..2026_11_30_00_00_{self.version:02d}.{os.getpid()}"
        new.mkdir()
        for name, text in files.items():
            (new / name).write_text(text)
        tmp = self.root / "..data_tmp"
        tmp.symlink_to(new.name)
        os.rename(tmp, self.root / "..data")  # the atomic swap
        for name in files:
            link = self.root / name
            if not link.is_symlink():
                link.symlink_to(f"..data/{name}")
        if self.current is not None:
            shutil.rmtree(self.current)
        self.current = new


def reloads(metrics: str, file: str, result: str) -> float:
    want = f'sluice_credential_reloads_total{{file="{file}",model="sim",result="{result}"}} '
    found = [ln for ln in metrics.splitlines() if ln.startswith(want)]
    return float(found[0].split()[-1]) if found else 0.0


async def eventually_reloaded(c: httpx.AsyncClient, file: str, result: str, count: float) -> None:
    async def reloaded() -> bool:
        return reloads((await c.get("/metrics")).text, file, result) >= count

    await eventually_async(reloaded, timeout=5, message=f"{count:g} {result} reload(s) of {file}")


async def ws_generate(ws, rid: str) -> None:
    await ws.send(json.dumps({"id": rid, "prompt": "a", "params": {"max_tokens": 2}}))


async def test_key_rotation_without_restart_while_a_stream_runs(tmp_path, caplog, capfd):
    caplog.set_level(logging.INFO)
    slow = SimulatorEngine(model_name="sim", ttft_ms=0, itl_ms=20)
    secret = MountedSecret(tmp_path / "secret")
    old, new = "sk-old-0123456789", "sk-new-9876543210"
    secret.write({"api-keys": f"{old} tenant=acme\n"})
    try:
        async with serve_simulator(slow, api_key_file=secret.root / "api-keys",
                                   credentials_reload_seconds=0.1) as url:  # fmt: skip
            async with (
                httpx.AsyncClient(base_url=url, timeout=30) as c,
                websockets.connect(ws_url(url), additional_headers=auth(old)) as ws_before,
            ):
                await ws_generate(ws_before, "before")
                while not json.loads(await asyncio.wait_for(ws_before.recv(), 10)).get("finished"):
                    pass
                assert (await stream(c, new)).status_code == 401
                body = {"prompt": "a b", "max_tokens": 100}  # 2 s of tokens
                async with c.stream("POST", "/v1/stream", json=body, headers=auth(old)) as r:
                    assert r.status_code == 200
                    lines = r.aiter_lines()
                    while not (await anext(lines)).startswith("data:"):
                        pass
                    secret.write({"api-keys": f"{new} tenant=acme\n"})  # rotate mid-stream
                    await eventually_reloaded(c, "api_keys", "ok", 1)
                    assert (await stream(c, old)).status_code == 401
                    assert (await stream(c, new)).status_code == 200
                    # A socket opened with the old key starts nothing more (one opened
                    # before the rotation: `ws_before`, which generated once then).
                    await ws_generate(ws_before, "after")
                    refused = json.loads(await asyncio.wait_for(ws_before.recv(), 10))
                    assert refused.get("type") == "error" and refused["id"] == "after", refused
                    assert refused["error"]["type"] == "authentication_error", refused
                    rest = [ln async for ln in lines if ln.startswith("data:")]
                final = json.loads(rest[-2][6:])
                assert rest[-1] == "data: [DONE]" and final["finish_reason"] == "length"
                assert final["usage"]["completion_tokens"] == 100  # untouched by the rotation

                # A bad new version: refused, the keys before it stay, the log says why.
                secret.write({"api-keys": f"{old} rpm=lots\n"})
                await eventually_reloaded(c, "api_keys", "error", 1)
                assert (await stream(c, new)).status_code == 200
                assert (await stream(c, old)).status_code == 401
                secret.write({"api-keys": f"{old}\n{new}\n"})  # fixed: both now
                await eventually_reloaded(c, "api_keys", "ok", 2)
                assert (await stream(c, old)).status_code == 200
    finally:
        await slow.shutdown()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                and r.name == "sluice_server.core.auth.reload"]  # fmt: skip
    assert len(warnings) == 1 and "line 1: rpm must be a whole number" in warnings[0], warnings
    lines = server_log_lines(caplog, capfd)
    assert not [ln for ln in lines for k in (old, new) if k in ln]


async def test_jwks_rotation_is_picked_up(sim, tmp_path):
    from jwt_helpers import AUDIENCE, ISSUER, Issuer, jwks

    before, after = Issuer("2026-10"), Issuer("2026-11", kind="ec")
    secret = MountedSecret(tmp_path / "jwks")
    secret.write({"jwks.json": json.dumps(jwks(before))})
    async with serve_simulator(sim, jwt_jwks_file=secret.root / "jwks.json", jwt_issuer=ISSUER,
                               jwt_audience=AUDIENCE, credentials_reload_seconds=0.1) as url:  # fmt: skip
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            assert (await stream(c, before.token())).status_code == 200
            assert (await stream(c, after.token())).status_code == 401
            secret.write({"jwks.json": json.dumps(jwks(before, after))})  # overlap
            await eventually_reloaded(c, "jwks", "ok", 1)
            assert (await stream(c, after.token())).status_code == 200
            assert (await stream(c, before.token())).status_code == 200
            secret.write({"jwks.json": json.dumps(jwks(after))})  # the old key retired
            await eventually_reloaded(c, "jwks", "ok", 2)
            assert (await stream(c, before.token())).status_code == 401
            secret.write({"jwks.json": '{"keys": []}'})  # refused: the last good set stays
            await eventually_reloaded(c, "jwks", "error", 1)
            assert (await stream(c, after.token())).status_code == 200


# --- API keys and per-key limits, every protocol ----------------------------------------
KEYS = ("sk-alpha-0123456789", "sk-bravo-9876543210")


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "api-keys"
    path.write_text(f"# mounted from a Secret\n{KEYS[0]}\n\n  {KEYS[1]}  \n")
    return path


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


async def finish_ok(c: httpx.AsyncClient, headers=None, max_tokens=2, **kw) -> dict:
    events = await sse_events(c, "POST", "/v1/stream", headers=headers,
                              json={"prompt": "still serving", "max_tokens": max_tokens}, **kw)  # fmt: skip
    final = token_payloads(events)[-1]
    assert final["finished"] and final["usage"]["completion_tokens"] == max_tokens, final
    return final


async def test_api_keys(sim, key_file, caplog):
    caplog.set_level(logging.DEBUG)
    async with serve_simulator(sim, api_key_file=key_file) as url:
        await _api_keys(url, caplog)


async def _api_keys(url: str, caplog) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        r = await c.post("/v1/stream", json={"prompt": "x"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert error_of(r)["code"] == "missing_api_key"
        r = await c.post("/v1/stream", json={"prompt": "x"}, headers=bearer("sk-alpha-01234567"))
        assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
        r = await c.post("/v1/chat/completions", headers=bearer("nope"),
                         json={"messages": [{"role": "user", "content": "x"}]})  # fmt: skip
        assert r.status_code == 401
        r = await c.get("/v1/models", headers={"Authorization": f"Basic {KEYS[0]}"})
        assert r.status_code == 401
        for key in KEYS:  # several keys in one file
            await finish_ok(c, headers=bearer(key))
        # EventSource cannot set headers: GET accepts ?api_key=
        events = await sse_events(c, "GET", "/v1/stream",
                                  params={"prompt": "q", "max_tokens": "1", "api_key": KEYS[1]})  # fmt: skip
        assert token_payloads(events)[-1]["finished"]
        # probes need no key
        for path in ("/health", "/ready", "/metrics"):
            assert (await c.get(path)).status_code == 200
        metrics = (await c.get("/metrics")).text
    assert 'sluice_rejections_total{model="sim",protocol="sse",reason="auth"} 2.0' in metrics
    assert 'sluice_rejections_total{model="sim",protocol="openai",reason="auth"} 2.0' in metrics

    with pytest.raises(websockets.InvalidStatus) as info:
        async with websockets.connect(ws_url(url)):
            pass
    assert info.value.response.status_code == 401
    for kw in ({"additional_headers": bearer(KEYS[0])}, {}):
        target = ws_url(url) + ("" if kw else f"?api_key={KEYS[1]}")
        async with websockets.connect(target, **kw) as ws:
            await ws.send(json.dumps({"id": 1, "prompt": "k", "params": {"max_tokens": 1}}))
            while not json.loads(await asyncio.wait_for(ws.recv(), 30))["finished"]:
                pass
    # keys never reach the server's logs (the test's own client libraries may log them)
    server_side = [r for r in caplog.records if not r.name.startswith(("websockets.client",
                   "httpx", "httpcore", "openai"))]  # fmt: skip
    assert server_side, "expected some server-side log records at DEBUG"
    assert not any(k in r.getMessage() for r in server_side for k in KEYS)


async def test_rate_limit_requests_per_minute(sim, key_file):
    async with serve_simulator(sim, api_key_file=key_file, rate_limit_rpm=2) as url, \
            httpx.AsyncClient(base_url=url, timeout=60) as c:  # fmt: skip
        await finish_ok(c, headers=bearer(KEYS[0]))
        await finish_ok(c, headers=bearer(KEYS[0]))
        r = await c.post("/v1/stream", json={"prompt": "x"}, headers=bearer(KEYS[0]))
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        err = error_of(r)
        assert err["type"] == "rate_limit_error" and "requests per minute" in err["message"]
        # per key: the other key is unaffected
        await finish_ok(c, headers=bearer(KEYS[1]))
        # the WebSocket draws on the same bucket: an error frame, the socket stays open
        async with websockets.connect(ws_url(url), additional_headers=bearer(KEYS[0])) as ws:
            await ws.send(json.dumps({"id": "r", "prompt": "x", "params": {"max_tokens": 1}}))
            f = json.loads(await asyncio.wait_for(ws.recv(), 30))
            assert f["type"] == "error" and f["id"] == "r"
            assert f["error"]["code"] == "rate_limit_exceeded"
        metrics = (await c.get("/metrics")).text
    assert 'protocol="sse",reason="rate_limit"} 1.0' in metrics
    assert 'protocol="websocket",reason="rate_limit"} 1.0' in metrics


async def test_rate_limit_tokens_per_minute(sim, key_file):
    async with serve_simulator(sim, api_key_file=key_file, rate_limit_tpm=30) as url, \
            httpx.AsyncClient(base_url=url, timeout=60) as c:  # fmt: skip
        await finish_ok(c, headers=bearer(KEYS[0]), max_tokens=40)  # prompt + 40 > 30
        r = await c.post("/v1/stream", json={"prompt": "x"}, headers=bearer(KEYS[0]))
        assert r.status_code == 429
        assert "tokens per minute" in error_of(r)["message"]
        assert int(r.headers["retry-after"]) >= 1
