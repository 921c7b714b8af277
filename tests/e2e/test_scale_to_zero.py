"""Scale to zero and back under the real control plane, on a live pod.

The operator runs as the chart runs it (its RBAC, its --activator-* flags); the model's pod
runs the real server (simulator engine) on a live node agent, so the idle signal is the
server's own `sluice_last_request_timestamp_seconds` and `sluice_active_streams`, read by the
operator from the pod's /metrics. The activator is a stub: a Pod object in the operator's
namespace with the activator's labels, marked Running and Ready on a loopback address where
the test serves its /metrics (held requests as the test sets them, and models known as the
operator's `sluice-activator-models` ConfigMap lists them, read from the API server). The
real kube-controller-manager runs the HPA and the Deployment controller.

What it shows: the model (minReplicas 0, idleSeconds 30) idles to zero and the Ingress
switches to its activator Service (ExternalName, upstream-vhost set) while the HPA stays
1..N and stops acting (ScalingDisabled) instead of fighting; held requests on the activator
scale it back to 1, the route switches back once the pod is Ready, and the HPA re-enables.
"""

from __future__ import annotations

import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from e2e_harness.kube import eventually
from kubernetes import client
from kubernetes.client.rest import ApiException

from .conftest import OPERATOR_NAMESPACE, TIMINGS
from .live_helpers import live_pods, pod_ready, ready_model, sim_model

pytestmark = [pytest.mark.slow]

IDLE_SECONDS = 30
ACTIVATOR = "sluice-activator"  # the chart's name for release "sluice"
LABELS = {
    "app.kubernetes.io/name": "sluice-activator",
    "app.kubernetes.io/instance": "sluice",
    "app.kubernetes.io/component": "activator",
}


class StubActivator:
    """The activator's /metrics as the operator reads it, on `ip`:8000."""

    def __init__(self, core: client.CoreV1Api, ip: str) -> None:
        self.core, self.ip = core, ip
        self.held: dict[tuple[str, str], int] = {}
        self.scrapes = 0
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path != "/metrics":
                    self.send_response(200 if self.path in ("/ready", "/health") else 404)
                    self.end_headers()
                    return
                body = stub.page().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer((ip, 8000), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def known(self) -> list[str]:
        try:
            cm = self.core.read_namespaced_config_map(f"{ACTIVATOR}-models", OPERATOR_NAMESPACE)
        except ApiException as e:
            if e.status == 404:
                return []
            raise
        return list(json.loads((cm.data or {}).get("models.json") or "{}"))

    def page(self) -> str:
        self.scrapes += 1
        lines = []
        for key in self.known():
            ns, name = key.split("/")
            lines.append(f'sluice_activator_models_known{{namespace="{ns}",model="{name}"}} 1')
        for (ns, name), n in self.held.items():
            lines.append(f'sluice_activator_held_requests{{namespace="{ns}",model="{name}"}} {n}')
        return "\n".join(lines) + "\n"

    def start(self) -> StubActivator:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def activator(admin, operator):
    """The stub activator: its server, and a Ready Pod object that names its address."""
    core = client.CoreV1Api(admin)
    ip = f"127.3.{random.randint(0, 250)}.{random.randint(1, 250)}"
    stub = StubActivator(core, ip).start()
    name = f"stub-activator-{ip.replace('.', '-')}"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": OPERATOR_NAMESPACE, "labels": LABELS},
        # Never scheduled (no node has the label): no kubelet reports on it but the test.
        "spec": {
            "nodeSelector": {"sluice.dev/e2e-nowhere": "true"},
            "containers": [{"name": "activator", "image": "stub"}],
        },
    }
    core.create_namespaced_pod(OPERATOR_NAMESPACE, pod)
    status = {
        "status": {
            "phase": "Running",
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "conditions": [{"type": "Ready", "status": "True"}],
        }
    }
    core.patch_namespaced_pod_status(name, OPERATOR_NAMESPACE, status)
    try:
        yield stub
    finally:
        core.delete_namespaced_pod(name, OPERATOR_NAMESPACE, grace_period_seconds=0)
        stub.stop()


def _backend(net: client.NetworkingV1Api, namespace: str, name: str) -> tuple[str, str | None]:
    ing = net.read_namespaced_ingress(name, namespace)
    service = ing.spec.rules[0].http.paths[0].backend.service.name
    vhost = (ing.metadata.annotations or {}).get("nginx.ingress.kubernetes.io/upstream-vhost")
    return service, vhost


def _hpa_scaling_active(scaling: client.AutoscalingV2Api, namespace: str, name: str) -> tuple:
    hpa = scaling.read_namespaced_horizontal_pod_autoscaler(name, namespace)
    cond = {c.type: c for c in (hpa.status.conditions or [])}.get("ScalingActive")
    return hpa.spec.min_replicas, (cond.status, cond.reason) if cond else None


def test_idle_model_scales_to_zero_routes_to_the_activator_and_demand_brings_it_back(
    operator, models, namespace, live_nodes, activator, admin
):
    apps, net = client.AppsV1Api(admin), client.NetworkingV1Api(admin)
    scaling = client.AutoscalingV2Api(admin)
    (node,), placement = live_nodes(1)
    name = "idle"
    body = sim_model(namespace, name, placement)
    body["spec"]["autoscaling"] = {
        "minReplicas": 0,
        "maxReplicas": 2,
        "scaleToZero": {"idleSeconds": IDLE_SECONDS, "holdTimeoutSeconds": 120},
    }
    models.create(body)
    key = f"{namespace}/{name}"

    # Up: one Ready replica, the route names the model's Service; the activator knows it.
    ready_model(models, namespace, name, timeout=120)
    eventually(lambda: _backend(net, namespace, name) == (name, None), timeout=30,
             message="the Ingress to name the model's Service")  # fmt: skip
    # The activator's allowlist is kept by the operator's poller (about every second): a
    # pod Ready a second after it was created can be Ready before the list names it.
    eventually(lambda: key in activator.known(), timeout=30, message="the activator's list")
    ext = client.CoreV1Api(admin).read_namespaced_service(f"{name}-activator", namespace)
    assert ext.spec.type == "ExternalName"
    assert ext.spec.external_name == f"{ACTIVATOR}.{OPERATOR_NAMESPACE}.svc.cluster.local"
    assert len(live_pods(models, namespace, name)) == 1  # the server the idle signal is from

    # Idle for idleSeconds: scaled to zero, the route goes to the activator.
    def at_zero():
        dep = apps.read_namespaced_deployment(name, namespace)
        return dep.spec.replicas == 0 and dep

    t0 = time.monotonic()
    eventually(at_zero, timeout=IDLE_SECONDS + 90, interval=1, message="the scale to zero")
    idle_s = time.monotonic() - t0
    assert _backend(net, namespace, name) == (
        f"{name}-activator", f"{name}.{namespace}.svc.cluster.local")  # fmt: skip
    eventually(lambda: models.get(namespace, name).get("status", {}).get("phase") == "ScaledToZero",
             timeout=60, interval=0.5, message="phase ScaledToZero")  # fmt: skip
    eventually(lambda: not live_pods(models, namespace, name), timeout=90, interval=1,
             message="the pod to go")  # fmt: skip

    # The HPA keeps 1..N and stands aside at zero (it does not scale the Deployment back).
    got = eventually(lambda: (s := _hpa_scaling_active(scaling, namespace, name))[1] == (
        "False", "ScalingDisabled") and s, timeout=60, interval=1,
        message="the HPA to report ScalingDisabled")  # fmt: skip
    assert got[0] == 1
    assert apps.read_namespaced_deployment(name, namespace).spec.replicas == 0
    scrapes_before = activator.scrapes

    # Demand: the activator holds 2 requests -> scaled to 1, Ready, route back.
    activator.held[(namespace, name)] = 2
    t0 = time.monotonic()
    eventually(lambda: apps.read_namespaced_deployment(name, namespace).spec.replicas == 1,
             timeout=30, interval=0.25, message="the scale to 1")  # fmt: skip
    assert activator.scrapes > scrapes_before  # the operator read the activator's page
    assert _backend(net, namespace, name)[0] == f"{name}-activator"  # not Ready yet
    eventually(lambda: any(pod_ready(p) for p in live_pods(models, namespace, name)),
             timeout=120, interval=0.5, message="the new pod to be Ready")  # fmt: skip
    wake_s = time.monotonic() - t0
    activator.held.clear()  # forwarded
    eventually(lambda: _backend(net, namespace, name) == (name, None), timeout=30,
             interval=0.25, message="the route back to the model's Service")  # fmt: skip
    ready_model(models, namespace, name, timeout=60)
    reasons = [e.reason for e in models.events_for(namespace, name)]
    assert {"ScaledToZero", "Activating", "Activated"} <= set(reasons), reasons
    # The HPA acts again (any reason but ScalingDisabled) and still keeps 1..N.
    got = eventually(lambda: (s := _hpa_scaling_active(scaling, namespace, name))[1] is not None
                   and s[1][1] != "ScalingDisabled" and s, timeout=60, interval=1,
                   message="the HPA to act again")  # fmt: skip
    assert got[0] == 1
    # The operator's own metrics counted both steps and timed the activation.
    text = httpx.get(f"http://127.0.0.1:{operator.metrics_port}/metrics", timeout=5).text
    mine = [line for line in text.splitlines() if f'namespace="{namespace}"' in line]
    zero, one = (
        [line for line in mine if line.startswith("sluice_operator_scale_to_zero_transitions_total")
         and f'to="{to}"' in line]
        for to in ("zero", "one")
    )  # fmt: skip
    assert [line.rsplit(" ", 1)[1] for line in zero + one] == ["1.0", "1.0"], mine
    (count,) = [
        line for line in mine if line.startswith("sluice_operator_activation_seconds_count")
    ]
    assert count.endswith(" 1.0"), mine
    TIMINGS["scale to zero: idle to 0 replicas, held request to Ready (s)"] = (
        round(idle_s, 1), round(wake_s, 1))  # fmt: skip
