"""Disaggregated serving on the pods' side (docs/disaggregation.md), on simulator servers:
`POST /internal/prefill` on a prefill pod returns NIXL-shaped params, and the original
request sent to a decode pod with them (`X-Sluice-KV-Transfer` beside the router key)
reports the prompt's full blocks as cached. Negative control: the same request without
the params reports 0 cached. Every protocol goes through the one entry; the entry and the
header refuse callers without the router's key."""

from __future__ import annotations

import json

import httpx
import pytest
import websockets
from app_helpers import serve_simulator, ws_url
from continuation_helpers import KEY, events_of
from sluice_server.core import kvtransfer
from sluice_server.engine.simulator import SimulatorEngine

pytestmark = pytest.mark.asyncio(loop_scope="session")

BLOCK = 16
WORDS = 45  # 2 full blocks before the last token: 32 cached tokens
PROMPT = " ".join(f"w{i}" for i in range(WORDS))
MESSAGES = [{"role": "user", "content": PROMPT}]
N = 6
BODIES = {
    "/v1/stream": {"prompt": PROMPT, "max_tokens": N},
    "/v1/chat/completions": {"model": "sim", "messages": MESSAGES, "max_tokens": N,
                             "stream": True, "stream_options": {"include_usage": True}},
    "/v1/completions": {"model": "sim", "prompt": PROMPT, "max_tokens": N,
                        "stream": True, "stream_options": {"include_usage": True}},
    "/v1/responses": {"model": "sim", "input": PROMPT, "max_output_tokens": N, "stream": True},
    "/v1/messages": {"model": "sim", "messages": MESSAGES, "max_tokens": N, "stream": True},
}  # fmt: skip
KEYED = {"X-Sluice-Continuation-Key": KEY}
CONNECTOR = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}


def sim(engine_id: str) -> SimulatorEngine:
    transfer = {**CONNECTOR, "engine_id": engine_id, "kv_ip": "10.0.0.7", "kv_port": 5600}
    return SimulatorEngine("sim", ttft_ms=2, itl_ms=1, block_size=BLOCK, kv_transfer=transfer)


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "router-key"
    path.write_text(KEY + "\n")
    return path


def cached_of(path: str, raw: str) -> int | None:
    """The cached prompt tokens a streamed answer's usage reports."""
    for event in events_of(raw):
        data = next((ln[6:] for ln in event.split("\n") if ln.startswith("data: {")), None)
        if data is None:
            continue
        obj = json.loads(data)
        usage = obj.get("usage") or (obj.get("response") or {}).get("usage")
        if not usage:
            continue
        if path == "/v1/messages" and "cache_read_input_tokens" in usage:
            return usage["cache_read_input_tokens"]
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
        if details is not None and obj.get("type") != "response.created":
            return details["cached_tokens"]
    return None


def metric(text: str, direction: str) -> float:
    for line in text.splitlines():
        if (
            line.startswith("sluice_kv_transfer_tokens_total{")
            and f'direction="{direction}"' in line
        ):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("path", list(BODIES))
async def test_prefill_on_one_pod_then_decode_on_another_counts_the_blocks_as_cached(
    key_file, path
):
    body = BODIES[path]
    async with (
        serve_simulator(sim("prefill-a"), continuation_key_file=key_file,
                        disaggregation_role="prefill") as p,
        serve_simulator(sim("decode-b"), continuation_key_file=key_file,
                        disaggregation_role="decode") as d,
        httpx.AsyncClient(base_url=p, timeout=30) as cp,
        httpx.AsyncClient(base_url=d, timeout=30) as cd,
    ):  # fmt: skip
        r = await cp.post(kvtransfer_path(), json={"path": path, "body": body}, headers=KEYED)
        assert r.status_code == 200, r.text
        answer = r.json()
        params = answer["kv_transfer_params"]
        assert answer["prompt_tokens"] >= WORDS
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert params["remote_engine_id"] == "prefill-a"
        assert (params["remote_host"], params["remote_port"]) == ("10.0.0.7", 5600)
        full = (answer["prompt_tokens"] - 1) // BLOCK
        assert len(params["remote_block_ids"]) == full == 2

        header = {**KEYED, "X-Sluice-KV-Transfer": kvtransfer.encode(params)}
        r = await cd.post(path, json=body, headers=header)
        assert r.status_code == 200, r.text
        assert cached_of(path, r.text) == full * BLOCK

        # Negative control: the same request without the params computes the whole prompt.
        r = await cd.post(path, json=body)
        assert r.status_code == 200, r.text
        assert cached_of(path, r.text) == 0

        out = metric((await cp.get("/metrics")).text, "out")
        assert out == answer["prompt_tokens"]
        assert metric((await cd.get("/metrics")).text, "in") == full * BLOCK


def kvtransfer_path() -> str:
    return "/internal/prefill"


async def test_a_whole_answer_reports_the_cached_tokens_too(key_file):
    body = {"model": "sim", "messages": MESSAGES, "max_tokens": N}
    async with (
        serve_simulator(sim("a"), continuation_key_file=key_file,
                        disaggregation_role="prefill") as p,
        serve_simulator(sim("b"), continuation_key_file=key_file,
                        disaggregation_role="decode") as d,
    ):  # fmt: skip
        async with httpx.AsyncClient(base_url=p) as c:
            r = await c.post("/internal/prefill", json={"path": "/v1/chat/completions",
                                                        "body": body}, headers=KEYED)  # fmt: skip
        params = r.json()["kv_transfer_params"]
        async with httpx.AsyncClient(base_url=d) as c:
            header = {**KEYED, "X-Sluice-KV-Transfer": kvtransfer.encode(params)}
            r = await c.post("/v1/chat/completions", json=body, headers=header)
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
            msgs = {"model": "sim", "messages": MESSAGES, "max_tokens": N}
            r = await c.post("/v1/messages", json=msgs, headers=header)
            usage = r.json()["usage"]
            assert usage["cache_read_input_tokens"] == 32
            assert usage["input_tokens"] == WORDS - 32


async def test_the_entry_is_the_routers_only(key_file):
    entry = {"path": "/v1/chat/completions", "body": BODIES["/v1/chat/completions"]}
    async with serve_simulator(sim("a")) as url, httpx.AsyncClient(base_url=url) as c:
        r = await c.post("/internal/prefill", json=entry, headers=KEYED)
        assert r.status_code == 404 and "prefill pods only" in r.text
    async with (
        serve_simulator(sim("a"), continuation_key_file=key_file,
                        disaggregation_role="decode") as url,
        httpx.AsyncClient(base_url=url) as c,
    ):  # fmt: skip
        assert (await c.post("/internal/prefill", json=entry, headers=KEYED)).status_code == 404
    async with (
        serve_simulator(sim("a"), continuation_key_file=key_file,
                        disaggregation_role="prefill") as url,
        httpx.AsyncClient(base_url=url) as c,
    ):  # fmt: skip
        r = await c.post("/internal/prefill", json=entry)
        assert r.status_code == 401 and "missing" in r.json()["error"]["message"]
        wrong = {"X-Sluice-Continuation-Key": "not-the-key"}
        r = await c.post("/internal/prefill", json=entry, headers=wrong)
        assert r.status_code == 403, r.text
        assert (await c.get("/internal/prefill", headers=KEYED)).status_code == 405


async def test_a_bad_request_is_refused_in_its_protocols_shape(key_file, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("sk-client\n")
    async with (
        serve_simulator(sim("a"), continuation_key_file=key_file, disaggregation_role="prefill",
                        api_key_file=keys) as url,
        httpx.AsyncClient(base_url=url) as c,
    ):  # fmt: skip
        client = {"Authorization": "Bearer sk-client", **KEYED}

        async def prefill(path: str, body: dict, headers=client) -> httpx.Response:
            return await c.post("/internal/prefill", json={"path": path, "body": body},
                                headers=headers)  # fmt: skip

        # The envelope: a path that does not generate, an unknown field.
        r = await prefill("/v1/models", {})
        assert r.status_code == 422 and r.json()["error"]["param"] == "path"
        r = await c.post("/internal/prefill", headers=client,
                         json={"path": "/v1/completions", "body": {}, "extra": 1})  # fmt: skip
        assert r.status_code == 422
        # The original request, validated as its route would: OpenAI's shape ...
        r = await prefill("/v1/chat/completions", {"model": "sim", "messages": []})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        r = await prefill("/v1/chat/completions", {**BODIES["/v1/chat/completions"],
                                                   "max_tokens": 0})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        # ... Anthropic's ...
        r = await prefill("/v1/messages", {"model": "sim", "messages": MESSAGES})
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        # ... the token stream's ...
        r = await prefill("/v1/stream", {"prompt": PROMPT, "max_tokens": 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        # ... and the caller's own credential is checked by the route.
        r = await prefill("/v1/completions", BODIES["/v1/completions"], KEYED)
        assert r.status_code == 401, r.text
        # A client may not name kv_transfer_params itself.
        own = {**BODIES["/v1/completions"], "kv_transfer_params": {"do_remote_prefill": True}}
        r = await c.post("/v1/completions", json=own, headers=client)
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"


async def test_the_kv_header_is_trusted_only_from_the_router_on_a_decode_pod(key_file):
    body = BODIES["/v1/completions"]
    params = {"do_remote_prefill": True, "remote_block_ids": [0, 1], "remote_engine_id": "x"}
    header = {"X-Sluice-KV-Transfer": kvtransfer.encode(params)}
    async with (
        serve_simulator(sim("d"), continuation_key_file=key_file,
                        disaggregation_role="decode") as url,
        httpx.AsyncClient(base_url=url) as c,
    ):  # fmt: skip
        for path in ("/v1/completions", "/v1/stream"):
            r = await c.post(path, json=BODIES[path], headers=header)
            assert r.status_code == 403 and "only from the Sluice router" in r.text, r.text
        wrong = {**header, "X-Sluice-Continuation-Key": "guess"}
        assert (await c.post("/v1/completions", json=body, headers=wrong)).status_code == 403
        bad = {**KEYED, "X-Sluice-KV-Transfer": "not base64 json!"}
        r = await c.post("/v1/completions", json=body, headers=bad)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_kv_transfer"
        r = await c.post("/v1/completions", json=body, headers={**KEYED, **header})
        assert r.status_code == 200 and cached_of("/v1/completions", r.text) == 2 * BLOCK
    async with (
        serve_simulator(sim("p"), continuation_key_file=key_file,
                        disaggregation_role="prefill") as url,
        httpx.AsyncClient(base_url=url) as c,
    ):  # fmt: skip
        r = await c.post("/v1/completions", json=body, headers={**KEYED, **header})
        assert r.status_code == 403 and "decode pod" in r.text


async def test_a_role_needs_the_router_key_and_a_real_engine_its_connector(tmp_path):
    from pydantic import ValidationError
    from sluice_server.settings import Settings

    with pytest.raises(ValidationError, match="needs --continuation-key-file"):
        Settings(model="m", engine="simulator", disaggregation_role="prefill")
    key = tmp_path / "k"
    key.write_text("k")
    with pytest.raises(ValidationError, match="needs --kv-transfer-config"):
        Settings(model="m", engine="vllm", disaggregation_role="decode", continuation_key_file=key)
    with pytest.raises(ValidationError, match="JSON object"):
        Settings(model="m", kv_transfer_config="[1]")


async def ws_final(url: str, frame: dict, headers: dict | None = None) -> dict:
    """The last frame of one generation on a new socket (its final frame or an error)."""
    async with websockets.connect(ws_url(url), additional_headers=headers or {}) as ws:
        await ws.send(json.dumps(frame))
        while True:
            msg = json.loads(await ws.recv())
            if msg.get("finished") or msg.get("type") == "error":
                return msg


async def test_a_websocket_generation_prefills_on_the_token_route_and_decodes_with_the_params(
    key_file,
):
    """The router prefills a socket's generation as `/v1/stream` (the frame's prompt and
    params as the body) and starts it on the decode pod's socket, opened with its key, with
    the params in the frame."""
    frame = {"id": 1, "prompt": PROMPT, "params": {"max_tokens": N}}
    async with (
        serve_simulator(sim("a"), continuation_key_file=key_file,
                        disaggregation_role="prefill") as p,
        serve_simulator(sim("b"), continuation_key_file=key_file,
                        disaggregation_role="decode") as d,
        httpx.AsyncClient(base_url=p) as cp,
    ):  # fmt: skip
        entry = {"path": "/v1/stream", "body": {"prompt": PROMPT, "max_tokens": N}}
        params = (await cp.post("/internal/prefill", json=entry, headers=KEYED)).json()
        params = params["kv_transfer_params"]
        assert len(params["remote_block_ids"]) == 2
        final = await ws_final(d, {**frame, "kv_transfer_params": params}, KEYED)
        assert final["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * BLOCK, final
        # Negative control: the same generation without the params.
        final = await ws_final(d, frame, KEYED)
        assert final["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, final
        # A client's socket (no router key) may not bring params.
        final = await ws_final(d, {**frame, "kv_transfer_params": params})
        assert final["type"] == "error" and final["error"]["code"] == "forbidden", final


async def test_a_path_under_the_servers_prefix_is_prefilled(key_file):
    """Through an Ingress that publishes the model under a prefix (`--root-path`), the
    router sends the client's path as it came: the entry reads the route under it.
    Negative control: a path under another prefix is no generating route."""
    body = BODIES["/v1/chat/completions"]
    async with (
        serve_simulator(sim("a"), continuation_key_file=key_file, disaggregation_role="prefill",
                        root_path="/team") as url,
        httpx.AsyncClient(base_url=url) as c,
    ):  # fmt: skip
        entry = {"path": "/team/v1/chat/completions", "body": body}
        r = await c.post("/internal/prefill", json=entry, headers=KEYED)
        assert r.status_code == 200 and r.json()["prompt_tokens"] >= WORDS, r.text
        entry = {"path": "/other/v1/chat/completions", "body": body}
        r = await c.post("/internal/prefill", json=entry, headers=KEYED)
        assert r.status_code == 422 and r.json()["error"]["param"] == "path", r.text
