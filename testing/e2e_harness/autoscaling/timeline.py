"""The autoscaling timeline: sampled every 2 s while the test runs, written as CSV and a PNG.

Columns: seconds since start, load (streams in flight), client TTFT p90 over the last 15 s,
the HPA's view of the metric (status.currentMetrics, the average over pods of the adapter's
per-pod p90 over 1 m), target, the HPA's desiredReplicas and currentReplicas, the
Deployment's ready replicas, pods Pending, all pods.
"""

from __future__ import annotations

import csv
import threading
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from kubernetes import client

from .loadgen import LoadGenerator

CLIENT_WINDOW = 15.0


@dataclass
class Row:
    t: float
    load: int
    client_p90_ms: float | None
    hpa_metric_ms: float | None
    target_ms: float
    desired: int | None
    current: int | None
    ready: int
    pending: int
    pods: int


def _quantity_ms(q: str | None) -> float | None:
    if q is None:
        return None
    if q.endswith("m"):
        return float(q[:-1])
    if q.endswith("u"):
        return float(q[:-1]) / 1000
    return float(q) * 1000


class Timeline:
    def __init__(self, api: client.ApiClient, namespace: str, name: str, load: LoadGenerator,
                 target_ms: float, interval: float = 2.0) -> None:  # fmt: skip
        self.apps = client.AppsV1Api(api)
        self.core = client.CoreV1Api(api)
        self.autoscaling = client.AutoscalingV2Api(api)
        self.namespace, self.name = namespace, name
        self.load = load
        self.target_ms = target_ms
        self.interval = interval
        self.rows: list[Row] = []
        self.events: list[tuple[float, str]] = []  # (t, label): phase marks for the plot
        self.errors: list[str] = []
        self.t0 = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="timeline", daemon=True)

    def start(self) -> Timeline:
        self.t0 = time.time()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def mark(self, label: str) -> None:
        self.events.append((round(time.time() - self.t0, 1), label))

    def last(self) -> Row | None:
        return self.rows[-1] if self.rows else None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.rows.append(self.sample())
            except Exception as e:  # keep sampling; the test reports errors if it matters
                self.errors.append(f"{type(e).__name__}: {e}")

    def sample(self) -> Row:
        now = time.time()
        hpa = self.autoscaling.read_namespaced_horizontal_pod_autoscaler(self.name, self.namespace)
        metric = None
        for m in hpa.status.current_metrics or []:
            if m.type == "Pods" and m.pods and m.pods.current:
                metric = _quantity_ms(m.pods.current.average_value)
        dep = self.apps.read_namespaced_deployment(self.name, self.namespace)
        pods = self.core.list_namespaced_pod(
            self.namespace, label_selector=f"app.kubernetes.io/instance={self.name}"
        ).items
        p90 = self.load.ttft_quantile(0.9, now - CLIENT_WINDOW, now)
        return Row(
            t=round(now - self.t0, 1),
            load=self.load.concurrency,
            client_p90_ms=round(p90 * 1000, 1) if p90 is not None else None,
            hpa_metric_ms=metric,
            target_ms=self.target_ms,
            desired=hpa.status.desired_replicas,
            current=hpa.status.current_replicas,
            ready=(dep.status.ready_replicas or 0),
            pending=sum(1 for p in pods if p.status.phase == "Pending"),
            pods=len(pods),
        )

    # --- output ---------------------------------------------------------------------
    def write_csv(self, path: Path) -> None:
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=[f.name for f in fields(Row)])
            w.writeheader()
            for r in self.rows:
                w.writerow(asdict(r))

    def plot(self, path: Path, title: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        t = [r.t for r in self.rows]
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True,
                                       gridspec_kw={"height_ratios": [3, 2]})  # fmt: skip
        ax1.plot(t, [r.client_p90_ms for r in self.rows], label="client TTFT p90 (15 s window)",
                 color="tab:blue")  # fmt: skip
        ax1.plot(t, [r.hpa_metric_ms for r in self.rows], label="HPA metric: mean of pod p90 (1 m)",
                 color="tab:orange")  # fmt: skip
        ax1.axhline(self.target_ms, color="tab:red", linestyle="--", label="target")
        ax1.set_ylabel("TTFT (ms)")
        ax1.legend(loc="upper right", fontsize=8)
        ax1.grid(alpha=0.3)
        ax2.step(t, [r.desired for r in self.rows], where="post", label="desired (HPA)",
                 color="tab:purple")  # fmt: skip
        ax2.step(t, [r.ready for r in self.rows], where="post", label="ready", color="tab:green")
        ax2.step(t, [r.pending for r in self.rows], where="post", label="Pending",
                 color="tab:gray", linestyle=":")  # fmt: skip
        ax2.set_ylabel("replicas")
        ax2.set_xlabel("seconds")
        ax2.legend(loc="upper right", fontsize=8)
        ax2.grid(alpha=0.3)
        top = max([r.pods for r in self.rows] + [1]) + 1
        ax2.set_ylim(-0.2, top)
        for ax in (ax1, ax2):
            for x, _label in self.events:
                ax.axvline(x, color="black", alpha=0.25)
        for x, label in self.events:
            ax1.annotate(label, (x, 1), xycoords=("data", "axes fraction"), fontsize=7,
                         rotation=90, va="top", ha="right")  # fmt: skip
        ax1.set_title(title, fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
