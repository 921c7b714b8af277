"""The adapter queries against a real Prometheus scraping the server's real metrics.

Two "pods" export the streaming server's own `Metrics` registry (sluice_server.metrics, so
metric and label names are the server's, not a copy): "busy" records a TTFT for a stream
every few milliseconds, "fresh" never serves. Prometheus (Debian package `prometheus`)
scrapes both every second with the namespace/pod labels a Kubernetes scrape job adds. The
five queries, expanded the way prometheus-adapter expands them, must give busy a quantile
inside the right bucket and fresh 0 (not NaN, not missing). Skips when prometheus or
sluice_server is not installed.
"""

from __future__ import annotations

import http.server
import json
import math
import shutil
import threading
import urllib.parse
import urllib.request

import pytest
import yaml
from testkit.net import free_port, wait_http
from testkit.process import ManagedProcess
from testkit.wait import eventually

from .test_prometheus_adapter_rules import PERCENTILES, _by_name

NAMESPACE = "llm"
# Per tick two SSE streams at 80 ms (bucket 0.075-0.1) and one WebSocket stream at 180 ms
# (bucket 0.15-0.2): two thirds of the streams are under 0.1 s, so p50 lands in the first
# bucket and p75 and above in the second, each with a wide margin from the boundary.
EXPECTED_RANGE = {
    0.5: (0.075, 0.1),
    0.75: (0.15, 0.2),
    0.9: (0.15, 0.2),
    0.95: (0.15, 0.2),
    0.99: (0.15, 0.2),
}


class Exporter:
    """A /metrics endpoint serving one sluice_server Metrics registry."""

    def __init__(self, metrics) -> None:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        registry = metrics.registry

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                body = generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def prometheus(tmp_path):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip(
            "prometheus not found (Debian package `prometheus`): live adapter query test skipped"
        )
    metrics_mod = pytest.importorskip(
        "sluice_server.core.telemetry.metrics", reason="sluice_server not installed"
    )

    busy_metrics = metrics_mod.Metrics("chat")
    fresh_metrics = metrics_mod.Metrics("chat")
    busy, fresh = Exporter(busy_metrics), Exporter(fresh_metrics)
    stop = threading.Event()

    def traffic() -> None:
        sse = busy_metrics.ttft.labels("sse", "chat")
        ws = busy_metrics.ttft.labels("websocket", "chat")
        while not stop.is_set():
            sse.observe(0.08)
            sse.observe(0.08)
            ws.observe(0.18)
            stop.wait(0.01)

    loader = threading.Thread(target=traffic, daemon=True)
    loader.start()

    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {
                "job_name": "kubernetes-pods",
                "static_configs": [
                    {
                        "targets": [f"127.0.0.1:{busy.port}"],
                        "labels": {"namespace": NAMESPACE, "pod": "busy"},
                    },
                    {
                        "targets": [f"127.0.0.1:{fresh.port}"],
                        "labels": {"namespace": NAMESPACE, "pod": "fresh"},
                    },
                ],
            }
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    proc = ManagedProcess(
        "prometheus",
        [
            binary,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        tmp_path,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        proc.start()
        wait_http(f"{base}/-/ready", timeout=60, process=proc)
        yield base
    finally:
        stop.set()
        proc.stop(timeout=15)
        loader.join(timeout=5)
        busy.close()
        fresh.close()


def _query(base: str, expr: str) -> dict[str, float]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return {s["metric"].get("pod", ""): float(s["value"][1]) for s in body["data"]["result"]}


def _expand(query: str) -> str:
    return query.replace(
        "<<.LabelMatchers>>", f'namespace="{NAMESPACE}",pod=~"busy|fresh"'
    ).replace("<<.GroupBy>>", "pod")


@pytest.mark.external  # Prometheus
def test_adapter_queries_on_live_prometheus(prometheus):
    rules = _by_name()

    # Wait until the rate window holds at least two scrapes of busy's increasing counters.
    def quantiles() -> dict[str, float]:
        got = _query(prometheus, _expand(rules["sluice_ttft_p90_seconds"]["metricsQuery"]))
        assert got.get("busy", 0) > 0 and "fresh" in got, got
        return got

    eventually(quantiles, timeout=60, interval=0.5, message="a quantile for busy")
    # The series the rules discover exist for both pods (the server pre-creates its labels).
    series = _query(prometheus, 'count by (pod) (sluice_ttft_seconds_count{namespace!="",pod!=""})')
    assert set(series) == {"busy", "fresh"}
    for label, q in PERCENTILES.items():
        got = _query(prometheus, _expand(rules[f"sluice_ttft_{label}_seconds"]["metricsQuery"]))
        lo, hi = EXPECTED_RANGE[q]
        assert lo <= got["busy"] <= hi, (label, got)
        assert got["fresh"] == 0.0, (label, got)
        assert set(got) == {"busy", "fresh"}
    # Negative control: the plain quantile gives the fresh pod NaN (or, before its second
    # scrape, nothing): either way the HPA would see no usable value for it.
    plain = _query(
        prometheus,
        _expand(
            "histogram_quantile(0.9, sum by (le, <<.GroupBy>>) (rate(sluice_ttft_seconds_bucket{<<.LabelMatchers>>}[1m])))"
        ),
    )
    assert "fresh" not in plain or math.isnan(plain["fresh"]), plain
    assert 0.15 <= plain["busy"] <= 0.2
