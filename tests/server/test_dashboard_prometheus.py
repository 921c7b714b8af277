"""The Grafana dashboard proven on real data: a real Sluice server (vLLM engine, tiny model)
under a short load with rejections, disconnects, a stop and stream errors, scraped every
second by Debian's Prometheus; every panel's every query (with the dashboard's variables
filled in) must return data, and data that moved during the load.

The HPA series (TTFT target, desired/current replicas) come from kube-state-metrics in a
cluster; a single test process has none, so a stand-in endpoint serves recorded
kube-state-metrics series for the model's HPA, scraped by the same Prometheus. The scale-to-
zero panel's series come from the activator (another process, in the operator's namespace):
a stand-in serves them in the activator's format, its counter moving on every scrape, and
is scraped as a pod of another namespace (its `namespace` label becomes
`exported_namespace`, as in most clusters). Everything else (sluice_*, vllm:*, up) is the
real server's own /metrics.

With SLUICE_DASHBOARD_PNG=<path> the main panels are also drawn from the same queries
(docs/observability.md's picture).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import websockets
from app_helpers import ws_url
from test_stream_backpressure import read_all, stalled_request
from testkit.wait import eventually_async

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

NAMESPACE, MODEL = "team-a", "chat"
POD = f"{MODEL}-5d8f7c9b6-x2k4p"
CAP = 8  # concurrent streams: above one round of the load, below its bursts
QUEUE = 4  # admission queue places: the bursts overflow it too
STREAM_TIMEOUT = 1.0  # seconds: the server's time limit on a stream
TOO_LONG = json.dumps({"prompt": "long", "max_tokens": 480, "ignore_eos": True}).encode()
# Series this load may leave flat at zero: nothing queues in the engine, the admission queue
# holds the bursts for well under a scrape interval, and the median queue wait is 0 (most
# requests find a free slot, and 0 is its own bucket; the same panel's p99 must move).
MAY_BE_ZERO = {("Engine running and waiting requests", "waiting"),
               ("Admission queue: waiting and shed", "waiting {{priority}}"),
               ("Admission queue: wait by priority", "p50 {{priority}}")}  # fmt: skip
KSM = f"""\
# HELP kube_horizontalpodautoscaler_spec_target_metric The metric specifications used by this autoscaler.
# TYPE kube_horizontalpodautoscaler_spec_target_metric gauge
kube_horizontalpodautoscaler_spec_target_metric{{namespace="{NAMESPACE}",horizontalpodautoscaler="{MODEL}",metric_name="sluice_ttft_p90_seconds",metric_target_type="average"}} 0.5
# HELP kube_horizontalpodautoscaler_status_desired_replicas Desired number of replicas.
# TYPE kube_horizontalpodautoscaler_status_desired_replicas gauge
kube_horizontalpodautoscaler_status_desired_replicas{{namespace="{NAMESPACE}",horizontalpodautoscaler="{MODEL}"}} 2
# HELP kube_horizontalpodautoscaler_status_current_replicas Current number of replicas.
# TYPE kube_horizontalpodautoscaler_status_current_replicas gauge
kube_horizontalpodautoscaler_status_current_replicas{{namespace="{NAMESPACE}",horizontalpodautoscaler="{MODEL}"}} 1
"""


def _prometheus_or_skip():
    import shutil

    if shutil.which("prometheus") is None:
        pytest.skip(
            "prometheus not found (Debian package `prometheus`: tests/scripts/install-tools.sh)"
        )
    from e2e_harness.autoscaling.prometheus import Prometheus

    return Prometheus


def activator_page(scrapes: int) -> str:
    labels = f'namespace="{NAMESPACE}",model="{MODEL}"'
    return (
        f"sluice_activator_held_requests{{{labels}}} {scrapes % 3}\n"
        f'sluice_activator_requests_total{{{labels},outcome="forwarded"}} {scrapes}\n'
    )


@contextlib.contextmanager
def kube_state_metrics(page=lambda n: KSM):
    scrapes = [0]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            scrapes[0] += 1
            body = page(scrapes[0]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def prometheus_config(sluice: str, ksm: str, activator: str) -> dict:
    return {
        "global": {"scrape_interval": "1s", "scrape_timeout": "900ms"},
        "scrape_configs": [
            {"job_name": "sluice", "static_configs": [
                {"targets": [sluice], "labels": {"namespace": NAMESPACE, "pod": POD}}]},
            {"job_name": "kube-state-metrics", "honor_labels": True,
             "static_configs": [{"targets": [ksm]}]},
            {"job_name": "activator", "static_configs": [{"targets": [activator], "labels": {
                "namespace": "sluice-system", "pod": "sluice-activator-6c7d8-abcde"}}]},
        ],
    }  # fmt: skip


def fill(expr: str) -> str:
    """The dashboard's variables as Grafana would fill them for this model."""
    return (
        expr.replace("$namespace", NAMESPACE)
        .replace("$model", MODEL)
        .replace("$__rate_interval", "10s")
    )


def query_range(prom, expr: str, start: float, end: float) -> list[dict]:
    data = prom._get("/api/v1/query_range", query=fill(expr), start=start, end=end, step=1)
    return data["result"]


def check_panels(prom, panels, start: float, end: float) -> dict:
    """Every target of every panel returns data that is not all zero (except MAY_BE_ZERO);
    the failure names the panel and the query."""
    problems, results = [], {}
    for panel in panels:
        for t in panel.targets:
            series = query_range(prom, t.expr, start, end)
            results[(panel.title, t.legend)] = series
            if not series:
                problems.append(f"panel {panel.title!r} ({t.legend}): no data for {fill(t.expr)}")
            elif (panel.title, t.legend) not in MAY_BE_ZERO and not any(
                float(v) != 0 for s in series for _, v in s["values"]
            ):
                problems.append(
                    f"panel {panel.title!r} ({t.legend}): only zeros for {fill(t.expr)}"
                )
    assert not problems, "\n".join(problems)
    return results


def scraped_since(prom, t: float) -> bool:
    """Every active target's last scrape began at or after wall-clock time `t`."""
    return all(_epoch(target["lastScrape"]) >= t for target in prom.targets())


def _epoch(rfc3339: str) -> float:
    """Prometheus's `lastScrape` ("2026-12-01T15:04:05.123456789Z", or with an offset)."""
    m = re.fullmatch(r"([^.]+?)(\.\d+)?(Z|[+-]\d\d:\d\d)", rfc3339)
    assert m, rfc3339
    base = dt.datetime.fromisoformat(m[1] + (m[3] if m[3] != "Z" else "+00:00"))
    return base.timestamp() + float(m[2] or 0)


async def load(url: str) -> None:
    """A short mixed load: finished streams on every protocol, capacity and bad-input
    refusals, client disconnects, a WebSocket stop, and streams cut by the time limit."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:

        async def finished(n=24):
            body = {"prompt": "hello", "max_tokens": n, "ignore_eos": True}
            async with c.stream("POST", "/v1/stream", json=body) as r:
                await r.aread()

        async def openai():
            body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 16, "stream": True}  # fmt: skip
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                await r.aread()

        async def disconnect():
            body = {"prompt": "bye", "max_tokens": 400, "ignore_eos": True}
            async with c.stream("POST", "/v1/stream", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        break

        async def too_long():
            """Cut by the time limit: an error after the 200. Its tokens come 5 ms apart
            (`Unhurried`), so the engine is still at it when the limit passes; the reader
            (a 1 KiB receive buffer) reads nothing for three time limits, then the rest,
            which ends with the error event."""
            port = int(url.rsplit(":", 1)[1])
            s, _ = await stalled_request(port, body=TOO_LONG)
            try:
                await asyncio.sleep(3 * STREAM_TIMEOUT)
                data = await read_all(s, limit_s=30)
            finally:
                s.close()
            assert b"event: error" in data and b"time limit" in data, data[-300:]

        async def stop() -> bool:
            """True once stopped; False when refused at capacity (slots of the round
            before, still being given back on a busy machine): no stream to stop then."""
            async with websockets.connect(ws_url(url)) as ws:
                await ws.send(json.dumps({"id": "s", "prompt": "k", "params": {"max_tokens": 400,
                                                                              "ignore_eos": True}}))  # fmt: skip
                first = json.loads(await asyncio.wait_for(ws.recv(), 30))
                if first.get("type") == "error":
                    assert first["error"]["type"] == "rate_limit_error", first
                    return False
                await ws.send(json.dumps({"type": "stop", "id": "s"}))
                while True:
                    frame = json.loads(await asyncio.wait_for(ws.recv(), 30))
                    assert frame.get("type") != "error", frame
                    if frame.get("finished"):
                        return True

        loop, stops = asyncio.get_running_loop(), 0
        began = loop.time()

        async def one_round() -> bool:
            """True once the load ran 10 s and at least one WebSocket stop went through."""
            nonlocal stops
            jobs = [finished(), finished(), openai(), disconnect(), stop()]
            jobs.append(too_long())
            results = await asyncio.gather(*jobs, return_exceptions=True)
            errors = [r for r in results if isinstance(r, Exception)]
            assert not errors, errors
            stops += results[4]
            # over capacity (more streams at once than --max-concurrent-streams), bad input
            body = {"prompt": "x", "max_tokens": 64, "ignore_eos": True}
            burst = await asyncio.gather(
                *(c.post("/v1/stream", json=body) for _ in range(CAP + QUEUE + 4))
            )
            assert 429 in {r.status_code for r in burst}
            assert (
                await c.post("/v1/stream", json={"prompt": "x", "max_tokens": 0})
            ).status_code == 400
            return bool(stops) and loop.time() - began >= 10

        # Rounds for 10 s, and on (up to 40 s in all) until a stop was not refused at capacity.
        await eventually_async(one_round, timeout=40, interval=0, retry_on=(),
                               message="a WebSocket stop not refused at capacity")  # fmt: skip


class Unhurried:
    """The session's engine, but the tokens of TOO_LONG's prompt reach the server 5 ms apart:
    its stream outlives STREAM_TIMEOUT however fast the machine. (An idle machine makes its
    480 tokens on the tiny model in under a second, and the sockets' kernel buffers take
    them all, so the stream would end before its time limit.)"""

    def __init__(self, engine) -> None:
        self._engine = engine

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    async def generate(self, request):
        async for delta in self._engine.generate(request):
            if request.prompt == "long":
                await asyncio.sleep(0.005 * max(1, delta.num_tokens))
            yield delta


async def test_every_panel_query_returns_data_from_a_real_server(make_server, tmp_path):
    Prometheus = _prometheus_or_skip()
    from sluice_operator.generate import dashboard

    url = await make_server(max_concurrent_streams=CAP, stream_timeout_seconds=STREAM_TIMEOUT,
                            queue_size=QUEUE, queue_timeout_seconds=5,
                            wrap_engine=Unhurried)  # fmt: skip
    with kube_state_metrics() as ksm, kube_state_metrics(activator_page) as activator:
        config = prometheus_config(url.removeprefix("http://"), ksm, activator)
        prom = Prometheus(tmp_path / "prom", tmp_path, config)
        await asyncio.to_thread(prom.start)
        try:
            start = time.time()

            async def loaded_and_seen() -> dict:
                """A load, two more scrapes of each target, then every panel. On a busy
                machine a scrape can time out during the load and a gauge then reads only
                its idle zeros: another round of load, until Prometheus recorded it move."""
                await load(url)
                loaded = time.time()
                await eventually_async(  # two more scrapes of each target after the load
                    lambda: asyncio.to_thread(scraped_since, prom, loaded + 1.0), timeout=30,
                    message="two scrapes of every target after the load")  # fmt: skip
                up = {t["labels"]["job"]: t["health"] for t in prom.targets()}
                assert up == {"sluice": "up", "kube-state-metrics": "up", "activator": "up"}, (
                    prom.targets())  # fmt: skip
                return await asyncio.to_thread(
                    check_panels, prom, dashboard.PANELS, start, time.time()
                )

            results = await eventually_async(
                loaded_and_seen, timeout=240, interval=0,
                message="every panel's queries with data that moved during the load")  # fmt: skip
            end = time.time()
            # Negative control: a query with a misspelt metric fails, naming its panel.
            bogus = dashboard.Panel("Bogus", "s", (dashboard.Target(
                dashboard.PANELS[0].targets[0].expr.replace("ttft", "tftt"), "p50"),))  # fmt: skip
            with pytest.raises(AssertionError, match="panel 'Bogus'"):
                check_panels(prom, (bogus,), start, end)
            # ... and so does a series that never moved (another model's pods).
            other = dashboard.Panel("Other model", "short", (dashboard.Target(
                dashboard.PANELS[2].targets[0].expr.replace("$model", "other"), "t"),))  # fmt: skip
            with pytest.raises(AssertionError, match="panel 'Other model'"):
                check_panels(prom, (other,), start, end)
            if os.environ.get("SLUICE_DASHBOARD_PNG"):
                draw(results, start, Path(os.environ["SLUICE_DASHBOARD_PNG"]))
        finally:
            await asyncio.to_thread(prom.stop)


def draw(results: dict, start: float, path: Path) -> None:
    """The main panels as Grafana would draw them, from the same query results."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = list(dict.fromkeys(title for title, _ in results))[:8]
    fig, axes = plt.subplots(4, 2, figsize=(13, 13), constrained_layout=True)
    for ax, title in zip(axes.flat, titles, strict=False):
        for (t, legend), series in results.items():
            if t != title:
                continue
            for s in series:
                xs = [float(x) - start for x, _ in s["values"]]
                ys = [
                    float(v) if v not in ("NaN", "+Inf") else float("nan") for _, v in s["values"]
                ]
                labels = s["metric"]
                label = re.sub(
                    r"\{\{(\w+)\}\}", lambda m, lb=labels: lb.get(m.group(1), ""), legend
                )
                ax.plot(xs, ys, label=label)
        ax.set_title(title)
        ax.set_xlabel("seconds into the load run")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(
        "Sluice / StreamingModels (tiny model on CPU, 10 s mixed load, Prometheus queries)"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
