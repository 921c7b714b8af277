"""LoRA adapters on the simulator engine (no model, seconds): served by name on every
protocol, unknown names 404 listing what is served, keys limited to some names, a broken
adapter Failed while the others serve, and hot add/remove through the watched file. The
real engine proves the same in test_adapters_engine.py."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
import websockets
from app_helpers import serve_simulator, sse_events, token_payloads, ws_url
from lora_helpers import make_adapter, write_adapters
from sluice_server.core.adapters import parse_adapters
from sluice_server.core.telemetry.accesslog import ACCESS_LOGGER
from sluice_server.engine.simulator import SimulatorEngine
from testkit.wait import eventually_async

pytestmark = pytest.mark.asyncio(loop_scope="session")
PROMPT = {"messages": [{"role": "user", "content": "hello river"}], "max_tokens": 6,
          "temperature": 0}  # fmt: skip


def sim() -> SimulatorEngine:
    return SimulatorEngine("sim", ttft_ms=2, itl_ms=1)


@pytest.fixture
def adapters(tmp_path):
    a = make_adapter(tmp_path / "a")
    b = make_adapter(tmp_path / "b")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{}")  # no rank: the engine refuses it
    path = tmp_path / "adapters.json"
    write_adapters(path, {"acme/a": a, "b": b, "broken": broken})
    return path, {"a": a, "b": b}


async def chat_text(c: httpx.AsyncClient, model: str | None) -> str:
    body = {**PROMPT, **({"model": model} if model else {})}
    r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


async def test_every_protocol_routes_by_model(adapters):
    path, _ = adapters
    async with serve_simulator(sim(), adapters_file=path) as url, \
            httpx.AsyncClient(base_url=url) as c:  # fmt: skip
        models = (await c.get("/v1/models")).json()["data"]
        assert [(m["id"], m.get("parent")) for m in models] == [
            ("sim", None), ("acme/a", "sim"), ("b", "sim")]  # fmt: skip
        base, a, b = [await chat_text(c, m) for m in (None, "acme/a", "b")]
        assert len({base, a, b}) == 3 and base == await chat_text(c, "sim")

        r = await c.post("/v1/completions", json={"model": "acme/a", "prompt": "hello river",
                                                  "max_tokens": 6})  # fmt: skip
        assert r.json()["choices"][0]["text"] == a
        r = await c.post("/v1/responses", json={"model": "b", "input": "hello river",
                                                "max_output_tokens": 6})  # fmt: skip
        assert r.json()["output"][0]["content"][0]["text"] == b
        r = await c.post("/v1/messages", json={"model": "b", "max_tokens": 6,
                                               "messages": PROMPT["messages"]})  # fmt: skip
        assert r.json()["content"][0]["text"] == b

        def text(events):
            return "".join(p["token"] for p in token_payloads(events))

        body = {"messages": PROMPT["messages"], "max_tokens": 6}
        post = await sse_events(c, "POST", "/v1/stream", json={**body, "model": "acme/a"})
        get = await sse_events(c, "GET", "/v1/stream", params={
            "messages": json.dumps(PROMPT["messages"]), "max_tokens": 6, "model": "b"})  # fmt: skip
        assert (text(post), text(get)) == (a, b)

        async with websockets.connect(ws_url(url)) as ws:
            for rid, model in (("1", "acme/a"), ("2", None), ("3", "b")):
                frame = {"id": rid, "messages": PROMPT["messages"], "params": {"max_tokens": 6}}
                frame.update({"model": model} if model else {})
                await ws.send(json.dumps(frame))
            got: dict[str, str] = {"1": "", "2": "", "3": ""}
            done = 0
            while done < 3:
                f = json.loads(await asyncio.wait_for(ws.recv(), 10))
                got[f["id"]] += f["token"]
                done += f["finished"]
        assert got == {"1": a, "2": base, "3": b}


async def test_unknown_and_broken_names_are_404_listing_what_is_served(adapters):
    path, _ = adapters
    async with serve_simulator(sim(), adapters_file=path) as url, \
            httpx.AsyncClient(base_url=url) as c:  # fmt: skip
        for model in ("nope", "broken"):
            for route, body in (("/v1/chat/completions", PROMPT),
                                ("/v1/stream", {"prompt": "x"}),
                                ("/v1/messages", {**PROMPT, "max_tokens": 4})):  # fmt: skip
                r = await c.post(route, json={**body, "model": model})
                err = r.json()["error"]
                assert r.status_code == 404, (route, r.text)
                # Each API's own error shape (Anthropic's has no `code`).
                assert err.get("code", "model_not_found") == "model_not_found", err
                assert "`sim`, `acme/a`, `b`" in err["message"], err
        async with websockets.connect(ws_url(url)) as ws:
            await ws.send(json.dumps({"id": 1, "prompt": "x", "model": "nope"}))
            f = json.loads(await asyncio.wait_for(ws.recv(), 10))
            assert f["type"] == "error" and f["error"]["code"] == "model_not_found"
        text = (await c.get("/metrics")).text
        assert 'adapter="broken"' in text and 'state="Failed"' in text
        assert "adapter_config.json" in text  # the reason
        assert 'sluice_adapter_loads_total{model="sim",result="failed"} 1.0' in text


async def test_adapter_requests_carry_the_adapter_in_metrics_and_access_log(adapters, caplog):
    path, _ = adapters
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    async with serve_simulator(sim(), adapters_file=path) as url, \
            httpx.AsyncClient(base_url=url) as c:  # fmt: skip
        await sse_events(c, "POST", "/v1/stream", json={"prompt": "x", "max_tokens": 3,
                                                         "model": "b"})  # fmt: skip
        await c.post("/v1/chat/completions", json={**PROMPT, "model": "acme/a", "stream": True})
        text = (await c.get("/metrics")).text
    assert 'sluice_output_tokens_total{model="b",protocol="sse"} 3.0' in text
    assert 'sluice_requests_total{model="acme/a",protocol="openai"} 1.0' in text
    lines = [r.getMessage() for r in caplog.records if r.name == ACCESS_LOGGER]
    assert any("model=b " in line and "path=/v1/stream" in line for line in lines), lines
    assert any("model=acme/a " in line for line in lines), lines


async def test_keys_limited_to_served_names(adapters, tmp_path):
    path, _ = adapters
    keys = tmp_path / "keys"
    keys.write_text("sk-all\nsk-a tenant=acme models=acme/a\nsk-base models=sim,b\n")
    async with serve_simulator(sim(), adapters_file=path, api_key_file=keys) as url, \
            httpx.AsyncClient(base_url=url) as c:  # fmt: skip

        async def status(key: str, model: str | None) -> int:
            body = {**PROMPT, **({"model": model} if model else {})}
            r = await c.post("/v1/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"})  # fmt: skip
            if r.status_code == 403:
                assert r.json()["error"]["code"] == "model_not_allowed"
            return r.status_code

        assert [await status("sk-all", m) for m in (None, "acme/a", "b")] == [200, 200, 200]
        assert [await status("sk-a", m) for m in (None, "acme/a", "b")] == [403, 200, 403]
        assert [await status("sk-base", m) for m in (None, "acme/a", "b")] == [200, 403, 200]
        r = await c.post("/v1/stream", json={"prompt": "x", "model": "b"},
                         headers={"Authorization": "Bearer sk-a"})  # fmt: skip
        assert r.status_code == 403

        async def listed(key: str) -> list[tuple[str, str | None]]:
            r = await c.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
            return [(m["id"], m.get("parent")) for m in r.json()["data"]]

        # /v1/models shows a key what it may use: all for a key without `models=`.
        assert await listed("sk-all") == [("sim", None), ("acme/a", "sim"), ("b", "sim")]
        assert await listed("sk-a") == [("acme/a", "sim")]
        assert await listed("sk-base") == [("sim", None), ("b", "sim")]


async def test_a_tokens_models_claim_limits_what_it_sees_and_uses(adapters, tmp_path):
    from jwt_helpers import AUDIENCE, ISSUER, Issuer, jwks

    path, _ = adapters
    issuer = Issuer("rsa-1")
    (tmp_path / "jwks.json").write_text(json.dumps(jwks(issuer)))
    limited, every = issuer.token(models=["b"]), issuer.token()
    async with serve_simulator(sim(), adapters_file=path, jwt_jwks_file=tmp_path / "jwks.json",
                               jwt_issuer=ISSUER, jwt_audience=AUDIENCE) as url, \
            httpx.AsyncClient(base_url=url) as c:  # fmt: skip

        async def listed(token: str) -> list[str]:
            r = await c.get("/v1/models", headers={"Authorization": f"Bearer {token}"})
            return [m["id"] for m in r.json()["data"]]

        assert await listed(every) == ["sim", "acme/a", "b"]
        assert await listed(limited) == ["b"]
        for model, status in (("b", 200), ("acme/a", 403), (None, 403)):
            body = {**PROMPT, **({"model": model} if model else {})}
            r = await c.post("/v1/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {limited}"})  # fmt: skip
            assert r.status_code == status, (model, r.text)


async def test_hot_add_and_remove_through_the_watched_file(adapters, tmp_path):
    path, dirs = adapters
    write_adapters(path, {"b": dirs["b"]})
    async with serve_simulator(sim(), adapters_file=path, adapters_reload_seconds=0.05) as url, \
            httpx.AsyncClient(base_url=url) as c:  # fmt: skip

        async def names():
            return [m["id"] for m in (await c.get("/v1/models")).json()["data"]]

        assert await names() == ["sim", "b"]
        new = make_adapter(tmp_path / "new")
        write_adapters(path, {"b": dirs["b"], "new": new})
        await eventually_async(lambda: _has(names, "new"), timeout=30, interval=0.1,
                               message="the new adapter listed")  # fmt: skip
        assert (
            await c.post("/v1/chat/completions", json={**PROMPT, "model": "new"})
        ).status_code == 200
        write_adapters(path, {"new": new})
        await eventually_async(lambda: _lacks(names, "b"), timeout=30, interval=0.1,
                               message="the removed adapter gone from the list")  # fmt: skip
        r = await c.post("/v1/chat/completions", json={**PROMPT, "model": "b"})
        assert r.status_code == 404
        # An unusable file changes nothing.
        path.write_text("{not json")
        await eventually_async(lambda: _metric(c, 'result="file_error"} 1.0'), timeout=30,
                               interval=0.1, message="the unusable file counted")  # fmt: skip
        assert await names() == ["sim", "new"]


async def _has(names, name) -> bool:
    return name in await names()


async def _lacks(names, name) -> bool:
    return name not in await names()


async def _metric(c: httpx.AsyncClient, fragment: str) -> bool:
    return fragment in (await c.get("/metrics")).text


@pytest.mark.parametrize(
    "text, message",
    [
        ("[]", "expected"),
        ('{"adapters": [{"uri": "/x"}]}', "needs a `name`"),
        ('{"adapters": [{"name": "sim", "uri": "/x"}]}', "base model's name"),
        ('{"adapters": [{"name": "a", "uri": "s3://x"}]}', "uri must be"),
        ('{"adapters": [{"name": "a", "uri": "/x"}, {"name": "a", "uri": "/y"}]}', "twice"),
        ('{"adapters": [{"name": "a b", "uri": "/x"}]}', "must match"),
        ('{"adapters": [{"name": "a", "uri": "/x", "rank": true}]}', "rank"),
    ],
)
async def test_unusable_adapter_files_are_refused_whole(text, message):
    with pytest.raises(ValueError, match=message):
        parse_adapters(text, "sim")


async def test_ids_from_the_file_or_derived_alike_in_every_process():
    one = parse_adapters('{"adapters": [{"name": "a", "uri": "/x", "id": "abc"}]}', "m")[0]
    two = parse_adapters('{"adapters": [{"name": "a", "uri": "/x"}]}', "m")[0]
    again = parse_adapters('{"adapters": [{"name": "a", "uri": "/x"}]}', "m")[0]
    assert one.id == "abc" and two.lora_id == again.lora_id != one.lora_id
    assert 0 < two.lora_id < 2**31
