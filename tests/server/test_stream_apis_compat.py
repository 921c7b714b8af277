"""Compatibility with vLLM's own server: vLLM's OpenAI API app (built and initialised as
`python -m vllm.entrypoints.openai.api_server` builds it) and our server, both on the
session engine, get the same requests at temperature 0. For OpenAI Responses and Anthropic
Messages, streamed: the same event type sequence and the same final text and usage; not
streamed: the same text and usage; `/tokenize`, `/detokenize` and
`/v1/messages/count_tokens`: the same answers. The simulator's built-in layer sends the
same event type sequence too (its text is its own).

One engine under both servers makes the engine arguments the same by construction and
saves a second engine start (a minute or more on 2 cores). Each request starts from an
empty prefix cache, so neither server's usage counts tokens cached by the other's request.

The number of text delta events per run of deltas is compared too, but only as a run:
vLLM's engine client merges outputs its consumer has not picked up yet (DELTA output
kind), so on a loaded machine either server may send one delta for two engine steps. The
text they carry must still match exactly.
"""

from __future__ import annotations

import json

import httpx
import pytest
import uvicorn
from app_helpers import serve_simulator, serving
from sluice_server.engine.simulator import SimulatorEngine
from testkit.net import free_port

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

MESSAGES = [{"role": "user", "content": "Tell me about the river."}]
REQUESTS = {
    "responses": ("/v1/responses", {"model": "tiny", "input": MESSAGES[0]["content"],
                                    "max_output_tokens": 32, "temperature": 0}),
    "anthropic": ("/v1/messages", {"model": "tiny", "max_tokens": 32, "temperature": 0,
                                   "messages": MESSAGES}),
}  # fmt: skip


@pytest.fixture(scope="module")
async def vllm_url(engine):
    """vLLM's own OpenAI API app on the session engine, served in this process on a free
    port (uvicorn without lifespan: vLLM's would freeze the test process's GC heap)."""
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    llm, port = engine.llm, free_port()  # vLLM's AsyncLLM under our engine
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(
        ["--model", llm.model_config.model, "--served-model-name", "tiny",
         "--host", "127.0.0.1", "--port", str(port)]
    )  # fmt: skip
    tasks = await llm.get_supported_tasks()
    app = build_app(args, tasks, llm.model_config)
    await init_app_state(llm, app.state, args, tasks)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off",
                            log_level="warning", access_log=False)  # fmt: skip
    async with serving(config):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture
def cold(engine):
    """`await cold()` before a request: the engine's prefix cache emptied."""

    async def reset() -> None:
        assert await engine.llm.reset_prefix_cache()

    return reset


async def stream_events(base: str, path: str, body: dict) -> list[tuple[str, dict]]:
    out = []
    async with httpx.AsyncClient(base_url=base, timeout=120) as c:
        async with c.stream("POST", path, json={**body, "stream": True}) as r:
            assert r.status_code == 200, await r.aread()
            event = None
            async for line in r.aiter_lines():
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: "):
                    out.append((event, json.loads(line[6:])))
                    event = None
    return out


def text_of(api: str, events: list[tuple[str, dict]]) -> str:
    kind = "response.output_text.delta" if api == "responses" else "content_block_delta"
    if api == "responses":
        return "".join(d["delta"] for t, d in events if t == kind)
    return "".join(d["delta"].get("text", "") for t, d in events if t == kind)


def runs(types: list[str]) -> list[str]:
    """The event type sequence with each run of a repeated type collapsed to one."""
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t]


def usage_of(api: str, events: list[tuple[str, dict]]) -> dict:
    if api == "responses":
        return events[-1][1]["response"]["usage"]
    return next(d["usage"] for t, d in events if t == "message_delta")


@pytest.mark.parametrize("api", list(REQUESTS))
async def test_streamed_events_match_vllms_server(vllm_url, server_url, cold, api):
    path, body = REQUESTS[api]
    await cold()
    theirs = await stream_events(vllm_url, path, body)
    await cold()
    ours = await stream_events(server_url, path, body)
    t_types, o_types = [t for t, _ in theirs], [t for t, _ in ours]
    print(f"\n{api}: vLLM {len(t_types)} events, ours {len(o_types)}; runs: {runs(o_types)}")
    assert runs(o_types) == runs(t_types)
    assert text_of(api, ours) == text_of(api, theirs) != ""
    assert usage_of(api, ours) == usage_of(api, theirs)
    # Every data payload names its own event type, as vLLM's does.
    assert all(d.get("type") == t for t, d in ours)
    async with serve_simulator(SimulatorEngine("tiny", ttft_ms=1, itl_ms=1),
                               served_model_name="tiny") as sim_url:  # fmt: skip
        simulated = await stream_events(sim_url, path, body)
    assert runs([t for t, _ in simulated]) == runs(t_types)


@pytest.mark.parametrize("api", list(REQUESTS))
async def test_whole_answers_match_vllms_server(vllm_url, server_url, cold, api):
    path, body = REQUESTS[api]
    async with httpx.AsyncClient(timeout=120) as c:
        await cold()
        theirs = (await c.post(vllm_url + path, json=body)).json()
        await cold()
        ours = (await c.post(server_url + path, json=body)).json()
    if api == "responses":

        def text(r):
            return r["output"][0]["content"][0]["text"]

        assert (ours["status"], ours["usage"]) == (theirs["status"], theirs["usage"])
    else:

        def text(r):
            return r["content"][0]["text"]

        assert (ours["stop_reason"], ours["usage"]) == (theirs["stop_reason"], theirs["usage"])
    assert text(ours) == text(theirs) != ""


async def test_utility_routes_match_vllms_server(vllm_url, server_url):
    calls = [("/tokenize", {"model": "tiny", "prompt": "The cat sends a message"}),
             ("/tokenize", {"model": "tiny", "messages": MESSAGES}),
             ("/detokenize", {"model": "tiny", "tokens": [5, 17, 42, 99]}),
             ("/v1/messages/count_tokens", {"model": "tiny", "messages": MESSAGES})]  # fmt: skip
    async with httpx.AsyncClient(timeout=60) as c:
        for path, body in calls:
            theirs = await c.post(vllm_url + path, json=body)
            ours = await c.post(server_url + path, json=body)
            assert (ours.status_code, ours.json()) == (theirs.status_code, theirs.json()), path
        assert (await c.get(server_url + "/version")).json() == (
            await c.get(vllm_url + "/version")
        ).json()
