"""Browser proofs: headless Chromium (tests/server/browser.py) on the real engine, through
real nginx configured like the operator's Ingress. Selenium blocks, so every browser
session runs in a thread while the servers keep running in the test's event loop.

- the playground streams a chat incrementally over EventSource and over fetch(): the
  server holds its sends at a few points (held_sends.py) and the page must show every
  token event sent so far before it sends more; through an nginx that buffers, it does
  not (the negative control). A causal check, no arrival timing, so load cannot fail it;
- Stop ends the WebSocket request at once;
- a page on another origin works when its origin is allowed and fails when it is not;
- a naive EventSource page that never calls close() starts exactly one generation (the
  browser does reconnect: it gets 204, closes the EventSource for good, and nothing follows
  in three more retry periods).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import time

import httpx
import pytest
from app_helpers import engine_settings, serving
from browser import chrome, missing, page_eventually, static_site
from held_sends import HeldSends
from testkit.net import free_port
from testkit.nginx_proxy import NginxProxy, find_nginx
from testkit.wait import eventually_async

# The browser, nginx and the servers on cores of their own, apart from the engine's
# (`engine_apart` in conftest.py): the engine's busy-polling core does not delay a Stop.
pytestmark = [
    pytest.mark.engine,
    pytest.mark.usefixtures("engine_apart"),
    pytest.mark.asyncio(loop_scope="session"),
]


@pytest.fixture(scope="module", autouse=True)
def browser_tools():
    why = missing() or (None if find_nginx() else "nginx not installed")
    if why:
        pytest.skip(f"browser tests skipped: {why}")


def ingress_annotations(**streaming) -> dict[str, str]:
    from sluice_operator.builders.ingress import desired_ingress
    from sluice_operator.validation import load_model

    body = {"apiVersion": "serving.sluice.dev/v1alpha1", "kind": "StreamingModel",
            "metadata": {"name": "m", "namespace": "default"},
            "spec": {"model": {"uri": "hf://x/y"}, "ingress": {"enabled": True},
                     "streaming": streaming}}  # fmt: skip
    return desired_ingress(load_model(body))["metadata"]["annotations"]


def requests_total(text: str, protocol: str) -> float:
    for ln in text.splitlines():
        if ln.startswith("sluice_requests_total{") and f'protocol="{protocol}"' in ln:
            return float(ln.rsplit(" ", 1)[1])
    raise AssertionError("sluice_requests_total not found")


async def metrics(url: str) -> str:
    async with httpx.AsyncClient() as c:
        return (await c.get(url + "/metrics")).text


# Token-carrying sends after which the server holds the playground's stream until the page
# shows every token event sent so far: the first, a few, many (of about 150).
HOLDS = [1, 5, 25]


@contextlib.asynccontextmanager
async def held_server(engine, tiny_model_path):
    """A server on the session engine whose streamed answers stop at each of `HOLDS`
    (held_sends.py); yields (url, HeldSends)."""
    from sluice_server.app import build_app
    from sluice_server.serve import uvicorn_config

    settings = engine_settings(tiny_model_path, port=free_port())
    held = HeldSends(build_app(settings, engine), HOLDS, engine=engine.llm)
    try:
        async with serving(uvicorn_config(settings, held)):
            yield f"http://127.0.0.1:{settings.port}", held
    finally:  # never leave the session's engine paused for the tests after this one
        await engine.llm.resume_generation()


def playground_chat(page: str, transport: str, held: HeldSends, show_s: float) -> dict:
    """Send from the playground; at each hold, the page must show every token event the
    server has sent (within `show_s`) before the server sends more."""
    with chrome() as d:
        d.get(page)
        page_eventually(d, "document.getElementById('model').textContent === 'tiny'")
        d.execute_script(f"""
            document.getElementById('transport').value = '{transport}';
            document.getElementById('max_tokens').value = '150';
            document.getElementById('temperature').value = '0';
            window.sluicePlayground.extra = {{ignore_eos: true}};
            document.getElementById('send').click();""")
        shown = []  # (token events the server had sent, events the page showed) per hold
        try:
            for index in range(len(held.holds)):
                try:
                    sent = held.held.get(timeout=120)  # the server holds after `sent` events
                except queue.Empty:
                    raise AssertionError(f"the server never reached hold {index}") from None
                n = page_eventually(d, f"(s => s.arrivals.length >= {sent} && s.arrivals.length)"
                                       "(window.sluicePlayground)", show_s)  # fmt: skip
                shown.append((sent, n))
                held.release(index)
        finally:
            held.release_all()
        page_eventually(d, "window.sluicePlayground.done", 120)
        got = d.execute_script("""const s = window.sluicePlayground;
            return {arrivals: s.arrivals, tokens: s.tokens, error: document.getElementById('out').className,
                    stats: document.getElementById('stats').textContent};""")
        return {**got, "shown": shown}


@pytest.mark.parametrize("transport", ["eventsource", "fetch"])
async def test_playground_streams_incrementally(engine, tiny_model_path, transport):
    """The page shows each token event before the server sends the next one, at each of
    `HOLDS`: through nginx configured like our Ingress, nothing buffers the answer."""
    async with held_server(engine, tiny_model_path) as (url, held):
        with NginxProxy(url, "ingress", annotations=ingress_annotations()) as proxy:
            got = await asyncio.to_thread(playground_chat, proxy.url + "/playground",
                                          transport, held, 60)  # fmt: skip
    span = (held.sent[-1] - held.sent[0]) * 1e3
    print(f"\nBROWSER playground {transport}: page showed {got['shown']} (server's events, "
          f"page's) at the holds; {len(held.sent)} events sent over {span:.0f} ms (holds "
          f"included), {len(got['arrivals'])} shown; {got['stats']}")  # fmt: skip
    assert not got["error"], got
    # At each hold the page showed every event sent so far (and there was nothing more it
    # could have shown).
    assert len(got["shown"]) == len(HOLDS), got["shown"]
    assert all(sent == shown for sent, shown in got["shown"]), got["shown"]
    assert held.timed_out == []
    assert len(got["arrivals"]) == len(held.sent) == got["tokens"]  # every event, once
    assert got["stats"].startswith("TTFT ") and "tokens/s" in got["stats"]


@pytest.mark.parametrize("transport", ["eventsource", "fetch"])
async def test_negative_control_a_buffering_nginx_fails_the_proof(engine, tiny_model_path,
                                                                  transport):  # fmt: skip
    """Through an nginx that buffers event streams (gzip, `X-Accel-Buffering` ignored) the
    page never shows the first held event, however long it waits: the proof above fails."""
    async with held_server(engine, tiny_model_path) as (url, held):
        with NginxProxy(url, "buffered") as proxy:
            with pytest.raises(AssertionError, match="arrivals.length >= 1 ") as failed:
                await asyncio.to_thread(playground_chat, proxy.url + "/playground",
                                        transport, held, 5)  # fmt: skip
    print(f"\nBROWSER playground {transport} via buffering nginx: "
          f"{str(failed.value).splitlines()[0]}")  # fmt: skip
    assert held.sent, "the server sent nothing: no proof either way"


def playground_stop(page: str, engine_busy) -> dict:
    with chrome() as d:
        d.get(page)
        page_eventually(d, "document.getElementById('model').textContent === 'tiny'")
        d.execute_script("""
            document.getElementById('transport').value = 'websocket';
            document.getElementById('max_tokens').value = '400';
            window.sluicePlayground.extra = {ignore_eos: true};
            document.getElementById('send').click();""")
        page_eventually(d, "window.sluicePlayground.arrivals.length >= 10", 120)
        assert engine_busy()
        t = time.monotonic()
        d.find_element("id", "stop").click()
        page_eventually(d, "window.sluicePlayground.done", 30)
        clicked_to_done = time.monotonic() - t
        return {"reason": d.execute_script("return window.sluicePlayground.finishReason"),
                "tokens": d.execute_script("return window.sluicePlayground.tokens"),
                "took": clicked_to_done}  # fmt: skip


async def test_playground_websocket_stop_ends_the_request(server_url, engine):
    with NginxProxy(server_url, "ingress", annotations=ingress_annotations()) as proxy:
        got = await asyncio.to_thread(playground_stop, proxy.url + "/playground",
                                      lambda: engine.num_unfinished_requests() > 0)  # fmt: skip
        await eventually_async(lambda: engine.num_unfinished_requests() == 0, timeout=2,
                               interval=0.01, message="the engine request to end after Stop")  # fmt: skip
    print(f"\nBROWSER stop: final frame {got['took'] * 1e3:.0f} ms after the click, "
          f"{got['tokens']} tokens of 400")  # fmt: skip
    assert got["reason"] == "abort" and got["tokens"] < 400


CROSS_ORIGIN_PAGE = """<!doctype html><meta charset="utf-8"><script>
window.result = null;
const base = new URLSearchParams(location.search).get("api");
fetch(base + "/v1/chat/completions", {method: "POST",
  headers: {"Content-Type": "application/json", "Authorization": "Bearer unused"},
  body: JSON.stringify({model: "tiny", max_tokens: 5, messages: [{role: "user", content: "hi"}]})})
 .then(r => r.json()).then(j => { window.result = {ok: true, tokens: j.usage.completion_tokens}; })
 .catch(e => { window.result = {ok: false, error: String(e)}; });
</script>"""


def cross_origin(site: str, api: str) -> dict:
    with chrome() as d:
        d.get(f"{site}/?api={api}")
        return page_eventually(d, "window.result", 60)


async def test_cross_origin_page_allowed_and_refused(make_server):
    with static_site(CROSS_ORIGIN_PAGE) as site:
        allowed = await make_server(cors_allowed_origins=site)
        other = await make_server(cors_allowed_origins="https://app.example.com")
        ann = ingress_annotations(cors={"allowedOrigins": [site]})
        with NginxProxy(allowed, "ingress", annotations=ann) as p1, \
                NginxProxy(other, "ingress", annotations=ann) as p2:  # fmt: skip
            ok = await asyncio.to_thread(cross_origin, site, p1.url)
            refused = await asyncio.to_thread(cross_origin, site, p2.url)
    print(f"\nBROWSER cross-origin: allowed -> {ok}; not allowed -> {refused}")
    assert ok == {"ok": True, "tokens": 5}
    assert refused["ok"] is False and "Failed to fetch" in refused["error"]


NAIVE_PAGE = """<!doctype html><meta charset="utf-8"><script>
// As most tutorials do: never calls close().
window.msgs = 0; window.done = 0; window.opens = 0;
const es = new EventSource("/v1/stream?prompt=hi&max_tokens=20");
es.onopen = () => { window.opens++; };
es.onmessage = (e) => { window.msgs++; if (e.data === "[DONE]") window.done++; };
</script>"""


def naive_event_source(page_url: str) -> dict:
    with chrome() as d:
        d.get(page_url)
        page_eventually(d, "window.done >= 1", 60)
        t = time.monotonic()
        # A 204 on the reconnect fails the connection for good (HTML spec: CLOSED, no more
        # reconnects); then three of its retry periods (<= 1 s each) show nothing follows.
        page_eventually(d, "es.readyState === EventSource.CLOSED", 30)
        time.sleep(3)
        state = d.execute_script("return {msgs: window.msgs, done: window.done, "
                                 "opens: window.opens}")  # fmt: skip
        state["watched"] = time.monotonic() - t
        return state


async def test_naive_event_source_starts_one_generation(make_server):
    url = await make_server()
    app = make_server.apps[url]

    @app.get("/naive")
    async def naive():  # the page on the server's own origin, as an app would host it
        from fastapi.responses import HTMLResponse

        return HTMLResponse(NAIVE_PAGE)

    with NginxProxy(url, "ingress", annotations=ingress_annotations()) as proxy:
        before = requests_total(await metrics(url), "sse")
        got = await asyncio.to_thread(naive_event_source, proxy.url + "/naive")
        after = requests_total(await metrics(url), "sse")
        log = (proxy.prefix / "access.log").read_text()
    streams = [ln for ln in log.splitlines() if "GET /v1/stream" in ln]
    codes = [ln.split('"')[2].split()[0] for ln in streams]
    print(
        f"\nBROWSER naive EventSource: {after - before:.0f} generation(s) in "
        f"{got['watched']:.0f} s after the answer; GET /v1/stream statuses: {codes}"
    )
    assert after - before == 1
    assert got["done"] == 1
    assert codes[:2] == ["200", "204"] and len(codes) == 2  # it reconnected once, then stopped
