"""Every protocol hands the engine the caller's `cache_salt` (core/auth/cachesalt.py): the
OpenAI chat and completions, Responses, Anthropic Messages, token SSE (POST and GET) and
the WebSocket, on a simulator that notes the salt of each request it starts. Tenants get
their own salts, a client's salt is combined with its tenant's, the sharing flag leaves
only the client's, and without auth nothing is salted."""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urlencode

import httpx
import pytest
import websockets
from app_helpers import serve_simulator, ws_url
from sluice_server.core.auth.cachesalt import CACHE_TENANT_HEADER, ROUTER_HEADER, cache_salt_for
from sluice_server.engine.simulator import SimulatorEngine

pytestmark = pytest.mark.asyncio(loop_scope="session")

KEYS = "sk-a1 tenant=acme\nsk-a2 tenant=acme\nsk-b tenant=globex\n"
PROTOCOLS = ["sse", "websocket", "responses", "anthropic"]
MESSAGES = [{"role": "user", "content": "the same prompt"}]


class Recording(SimulatorEngine):
    """The simulator, noting the salt of each request it is given."""

    def __init__(self) -> None:
        super().__init__(model_name="sim", ttft_ms=1, itl_ms=1)
        self.salts: list[str | None] = []

    def generate(self, request):
        self.salts.append(request.cache_salt)
        return super().generate(request)


async def send(c: httpx.AsyncClient, url: str, route: str, key: str, salt: str | None) -> None:
    """One generation through `route`, with the client's own `salt` when not None."""
    extra = {} if salt is None else {"cache_salt": salt}
    auth = {"Authorization": f"Bearer {key}"}
    if route == "ws":
        async with websockets.connect(ws_url(url) + f"?api_key={key}") as ws:
            await ws.send(json.dumps({"id": "w", "prompt": "the same prompt",
                                      "params": {"max_tokens": 2, **extra}}))  # fmt: skip
            while not json.loads(await asyncio.wait_for(ws.recv(), 10)).get("finished"):
                pass
        return
    if route == "GET /v1/stream":
        q = urlencode({"prompt": "the same prompt", "max_tokens": 2, **extra})
        r = await c.get(f"/v1/stream?{q}", headers=auth)
    else:
        body = {
            "/v1/chat/completions": {"messages": MESSAGES, "max_tokens": 2},
            "/v1/completions": {"prompt": "the same prompt", "max_tokens": 2},
            "/v1/responses": {"input": "the same prompt", "max_output_tokens": 2},
            "/v1/messages": {"messages": MESSAGES, "max_tokens": 2},
            "/v1/stream": {"prompt": "the same prompt", "max_tokens": 2},
        }[route]
        r = await c.post(route, json={"model": "sim", **body, **extra}, headers=auth)
    assert r.status_code == 200, r.text


ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
          "/v1/stream", "GET /v1/stream", "ws"]  # fmt: skip


@pytest.mark.parametrize("route", ROUTES)
async def test_every_route_salts_by_tenant_and_keeps_the_clients_salt(tmp_path, route):
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    eng = Recording()
    async with serve_simulator(eng, api_key_file=keys, protocols=PROTOCOLS) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            for key, salt in (("sk-a1", None), ("sk-a2", None), ("sk-b", None),
                              ("sk-a1", "mine"), ("sk-b", "mine")):  # fmt: skip
                await send(c, url, route, key, salt)
    acme, acme2, globex, acme_mine, globex_mine = eng.salts
    assert acme == acme2 == cache_salt_for("acme", None, False)  # one tenant, one cache
    assert globex == cache_salt_for("globex", None, False) != acme
    assert acme_mine == cache_salt_for("acme", "mine", False) not in (acme, "mine")
    assert globex_mine == cache_salt_for("globex", "mine", False) != acme_mine


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/stream", "ws"])
async def test_shared_across_tenants_only_the_clients_salt_reaches_the_engine(tmp_path, route):
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    eng = Recording()
    async with serve_simulator(eng, api_key_file=keys, protocols=PROTOCOLS,
                               share_prefix_cache_across_tenants=True) as url:  # fmt: skip
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            for key, salt in (("sk-a1", None), ("sk-b", None), ("sk-b", "mine")):
                await send(c, url, route, key, salt)
    assert eng.salts == [None, None, "mine"]


@pytest.mark.parametrize("route", ["/v1/messages", "GET /v1/stream", "ws"])
async def test_without_auth_there_is_one_tenant_and_no_salt(route):
    eng = Recording()
    async with serve_simulator(eng, protocols=PROTOCOLS) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            await send(c, url, route, "any", None)
            await send(c, url, route, "any", "mine")
    assert eng.salts == [None, "mine"]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/responses", "/v1/stream"])
async def test_a_salt_vllm_would_refuse_is_a_400_naming_it(tmp_path, route):
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    eng = Recording()
    async with serve_simulator(eng, api_key_file=keys, protocols=PROTOCOLS) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            body = {"model": "sim", "messages": MESSAGES, "input": "x", "prompt": "x"}
            if route == "/v1/stream":
                body = {"prompt": "x"}
            r = await c.post(route, json={**body, "cache_salt": "a/b"},
                             headers={"Authorization": "Bearer sk-a1"})  # fmt: skip
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "cache_salt" and err["message"].startswith("cache_salt: ")
    assert eng.salts == []


async def test_a_router_learns_the_tenant_it_must_salt_with_and_nobody_else_does(tmp_path):
    """Asked by the router (`ROUTER_HEADER`), the pod names the tenant whose salt it applies
    (`CACHE_TENANT_HEADER`); a request without it, sharing on, or auth off
    gets no such header."""
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    body = {"prompt": "x", "max_tokens": 2}
    via = {ROUTER_HEADER: "1"}

    async def tenant_header(url: str, key: str, headers: dict[str, str]) -> str | None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            r = await c.post("/v1/stream", json=body,
                             headers={"Authorization": f"Bearer {key}", **headers})  # fmt: skip
            assert r.status_code == 200, r.text
            return r.headers.get(CACHE_TENANT_HEADER)

    async with serve_simulator(Recording(), api_key_file=keys, protocols=PROTOCOLS) as url:
        assert await tenant_header(url, "sk-a1", via) == "acme"
        assert await tenant_header(url, "sk-a1", {}) is None  # not asked: not told
        async with websockets.connect(ws_url(url) + "?api_key=sk-b",
                                      additional_headers=via) as ws:  # fmt: skip
            assert ws.response.headers.get(CACHE_TENANT_HEADER) == "globex"
    async with serve_simulator(Recording(), api_key_file=keys, protocols=PROTOCOLS,
                               share_prefix_cache_across_tenants=True) as url:  # fmt: skip
        assert await tenant_header(url, "sk-a1", via) is None  # sharing on: no tenant salt
    async with serve_simulator(Recording(), protocols=PROTOCOLS) as url:
        assert await tenant_header(url, "any", via) is None  # auth off: no tenant salt
