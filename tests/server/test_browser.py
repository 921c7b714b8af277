"""Browser proofs: headless Chromium (tests/server/browser.py) on the real engine, through
real nginx configured like the operator's Ingress. Selenium blocks, so every browser
session runs in a thread while the servers keep running in the test's event loop.

- the playground streams a chat incrementally (many distinct arrival times) over
  EventSource and over fetch(), and Stop ends the WebSocket request at once;
- a page on another origin works when its origin is allowed and fails when it is not;
- a naive EventSource page that never calls close() starts exactly one generation in the
  15 s after its answer ended (the browser does reconnect: it gets 204 and stops).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from browser import chrome, missing, page_eventually, static_site
from nginx_proxy import NginxProxy, find_nginx
from testkit.wait import eventually_async

# The browser, nginx and the servers on cores of their own, apart from the engine's (the
# arrival times of a stream are the verdict here): `engine_apart` in conftest.py.
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


def playground_chat(page: str, transport: str) -> dict:
    with chrome() as d:
        d.get(page)
        page_eventually(d, "document.getElementById('model').textContent === 'tiny'")
        d.execute_script(f"""
            document.getElementById('transport').value = '{transport}';
            document.getElementById('max_tokens').value = '150';
            document.getElementById('temperature').value = '0';
            window.sluicePlayground.extra = {{ignore_eos: true}};
            document.getElementById('send').click();""")
        page_eventually(d, "window.sluicePlayground.done", 120)
        return d.execute_script("""const s = window.sluicePlayground;
            return {arrivals: s.arrivals, tokens: s.tokens, error: document.getElementById('out').className,
                    stats: document.getElementById('stats').textContent};""")


@pytest.mark.parametrize("transport", ["eventsource", "fetch"])
async def test_playground_streams_incrementally(server_url, transport):
    with NginxProxy(server_url, "ingress", annotations=ingress_annotations()) as proxy:
        got = await asyncio.to_thread(playground_chat, proxy.url + "/playground", transport)
    arrivals = got["arrivals"]
    distinct = len({round(a) for a in arrivals})  # distinct milliseconds
    span = arrivals[-1] - arrivals[0]
    print(f"\nBROWSER playground {transport}: {len(arrivals)} events at {distinct} distinct ms "
          f"over {span:.0f} ms; {got['stats']}")  # fmt: skip
    assert not got["error"], got
    # Not one burst at the end: the answer arrives over many moments. (Bunched into fewer
    # of them when vLLM's CPU engine holds the cores the server and the browser share.)
    assert distinct >= 10, got
    assert got["stats"].startswith("TTFT ") and "tokens/s" in got["stats"]


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
        time.sleep(15)
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
