"""Resumable token streams on the real engine, through real nginx configured from the
Ingress annotations the operator renders (cookie affinity), with two servers behind one
upstream: a stream dropped mid-way and resumed with Last-Event-ID gives exactly the
uninterrupted answer (temperature 0), and the engine generated it once.

The two servers are two uvicorn apps on one shared engine in this process (one vLLM
engine per test session on a 2-core machine): each has its own stream registry, so a
reconnect that reached the wrong one would get 404, and the engine's own step log counts
what was generated. Negative controls: without the affinity cookie a reconnect reaches the
other server (404), and with grace 0 the dropped stream is gone (410).
"""

from __future__ import annotations

import json
import statistics
import time

import httpx
import pytest
from app_helpers import PROBE, engine_flushed
from testkit.nginx_proxy import NginxProxy, find_nginx
from testkit.wait import eventually_async

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]

N_TOKENS = 120
BODY = {"prompt": "The river", "max_tokens": N_TOKENS, "ignore_eos": True, "temperature": 0}
# Where to drop: after this share of the answer's token events (some tokens of the tiny
# model decode to no text, so there are fewer events than tokens).
CUTS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.75, 0.9, 0.97)


def rendered_annotations(grace: int) -> dict[str, str]:
    from sluice_operator.builders.ingress import desired_ingress
    from sluice_operator.validation import load_model

    body = {"apiVersion": "serving.sluice.dev/v1alpha1", "kind": "StreamingModel",
            "metadata": {"name": "m", "namespace": "default"},
            "spec": {"model": {"uri": "hf://x/y"}, "ingress": {"enabled": True},
                     "streaming": {"resume": {"graceSeconds": grace}}}}  # fmt: skip
    return desired_ingress(load_model(body))["metadata"]["annotations"]


CORE_TOKENS: list[int] = []


@pytest.fixture
def core_tokens(engine):
    """Tokens the engine core made (every batch, before any filtering)."""
    op = engine.llm.output_processor
    real = op.process_outputs

    def spy(outputs, *args, **kwargs):
        made = sum(len(o.new_token_ids) for o in outputs if not o.request_id.startswith(PROBE))
        CORE_TOKENS.append(made)
        return real(outputs, *args, **kwargs)

    CORE_TOKENS.clear()
    op.process_outputs = spy
    try:
        yield CORE_TOKENS
    finally:
        del op.process_outputs


async def settle(engine) -> None:
    """No unfinished engine request, and every batch the core made counted."""
    await eventually_async(lambda: engine.num_unfinished_requests() == 0, timeout=30,
                           interval=0.01, message="the engine request to finish")  # fmt: skip
    await engine_flushed(engine)


async def read_events(r: httpx.Response, n: int | None = None, stamp: list | None = None):
    """Events until `n` token events or the end; `stamp` gets the time of the first."""
    out, cur, tokens = [], {}, 0
    async for line in r.aiter_lines():
        if line == "":
            if cur:
                if stamp is not None and not out:
                    stamp.append(time.perf_counter())
                out.append(cur)
                if '"finished":false' in cur.get("data", ""):
                    tokens += 1
                    if n is not None and tokens >= n:
                        return out
            cur = {}
        elif not line.startswith(":"):
            field, _, value = line.partition(":")
            cur[field] = value.removeprefix(" ")
    return out


def text_of(events: list[dict]) -> str:
    return "".join(json.loads(e["data"])["token"] for e in events
                   if e.get("data", "").startswith("{") and "event" not in e)  # fmt: skip


def metric_sum(texts: list[str], name: str) -> float:
    total = 0.0
    for text in texts:
        for ln in text.splitlines():
            if ln.startswith(name + "{") and 'protocol="sse"' in ln:
                total += float(ln.rsplit(" ", 1)[1])
    return total


async def interrupted(url: str, cut: int, cookies: bool = True):
    """Read `cut` token events, drop the TCP connection, reconnect with Last-Event-ID.
    Returns (first events, the reconnect's response status, rest events, reconnect
    seconds: drop -> first replayed event)."""
    a = httpx.AsyncClient(base_url=url, timeout=60)
    async with a.stream("POST", "/v1/stream", json=BODY) as r:
        assert r.status_code == 200
        first = await read_events(r, cut)
        jar = httpx.Cookies(a.cookies) if cookies else None
        t_drop = time.perf_counter()
        await a.aclose()
    async with httpx.AsyncClient(base_url=url, timeout=60, cookies=jar) as b:
        async with b.stream("POST", "/v1/stream", json=BODY,
                            headers={"Last-Event-ID": first[-1]["id"]}) as r:  # fmt: skip
            if r.status_code != 200:
                await r.aread()
                return first, r.status_code, [], 0.0
            stamp: list[float] = []
            rest = await read_events(r, stamp=stamp)
    return first, 200, rest, stamp[0] - t_drop


@pytest.fixture(scope="module")
def nginx_required():
    if find_nginx() is None:
        pytest.skip("nginx not installed")


async def test_resume_through_nginx_with_affinity(make_server, engine, core_tokens,
                                                   nginx_required):  # fmt: skip
    urls = [await make_server(resume_grace_seconds=10) for _ in range(2)]
    ann = rendered_annotations(10)
    with NginxProxy(urls, "ingress", annotations=ann) as proxy:
        async with httpx.AsyncClient(base_url=proxy.url, timeout=60) as c:
            events = await read_events_whole(c)
        whole = text_of(events)
        n_events = sum('"finished":false' in e.get("data", "") for e in events)
        await settle(engine)
        ok, reconnects, whole_before_drop = 0, [], 0
        for share in CUTS:
            cut = max(1, min(n_events - 1, round(share * n_events)))
            await settle(engine)
            before_req = metric_sum([await _metrics(u) for u in urls], "sluice_requests_total")
            core_tokens.clear()
            first, status, rest, took = await interrupted(proxy.url, cut)
            await settle(engine)
            after_req = metric_sum([await _metrics(u) for u in urls], "sluice_requests_total")
            generated = sum(core_tokens)
            assert after_req - before_req == 1, "a reconnect started a generation"
            assert generated == N_TOKENS, f"the engine made {generated} tokens for one answer"
            if first[-1].get("data") == "[DONE]":
                # Tokens coalesced into fewer events under load: the first read got to the
                # end before `cut` token events, so the reconnect has nothing to resume.
                assert status == 204, status
                whole_before_drop += 1
                continue
            ids = [int(e["id"].rsplit(":", 1)[1]) for e in first + rest]
            good = (status == 200 and text_of(first) + text_of(rest) == whole
                    and ids == list(range(len(ids))) and rest[-1]["data"] == "[DONE]")  # fmt: skip
            ok += good
            reconnects.append(took)
            assert good, (cut, status, text_of(first) + text_of(rest), whole)
        print(
            f"\nRESUME through nginx: {ok}/{len(CUTS)} interrupted streams resumed exactly; "
            f"reconnect (drop -> first replayed event) median "
            f"{statistics.median(reconnects) * 1e3:.1f} ms, max {max(reconnects) * 1e3:.1f} ms"
        )
        m = [await _metrics(u) for u in urls]
        assert metric_sum(m, "sluice_stream_resumes_total") == len(CUTS) - whole_before_drop
        assert whole_before_drop <= 2, "most cuts must interrupt a stream"
        assert metric_sum(m, "sluice_stream_resumes_expired_total") == 0

        # Negative control: without the affinity cookie, round robin sends the reconnect
        # to the other server, which does not have the stream.
        statuses = set()
        for cut in (10, 10):
            _, status, _, _ = await interrupted(proxy.url, cut, cookies=False)
            statuses.add(status)
        await settle(engine)
        assert 404 in statuses, statuses


async def read_events_whole(c: httpx.AsyncClient) -> list[dict]:
    async with c.stream("POST", "/v1/stream", json=BODY) as r:
        return await read_events(r)


async def _metrics(url: str) -> str:
    async with httpx.AsyncClient() as c:
        return (await c.get(url + "/metrics")).text


async def test_grace_zero_cannot_resume(make_server, engine, nginx_required):
    """Negative control: the same drop with resume off aborts the request; the reconnect
    gets 410 and the answer stays incomplete (and the abort guarantee holds:
    test_stream_abort.py runs on the default, grace-0 server)."""
    urls = [await make_server() for _ in range(2)]
    with NginxProxy(urls, "ingress", annotations=rendered_annotations(0)) as proxy:
        assert not [k for k in rendered_annotations(0) if "affinity" in k]
        first, status, rest, _ = await interrupted(proxy.url, 20)
        await settle(engine)
    assert status in (404, 410) and not rest  # no affinity: either server may answer
