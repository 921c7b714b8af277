"""Shared pieces of the live-pod scenarios (test_live_*.py, test_router_*_live.py): the
simulator model they deploy, a bound claim for real weights, the chart's router on the live
node, waiting for a model and for the ingress to route it, reading what the node agent and
the servers recorded (access logs included) and what a stream said."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Collection
from datetime import datetime

import httpx
from e2e_harness.endpoints import Endpoint, ready_endpoints
from e2e_harness.kube import eventually, load_sample
from e2e_harness.operator_process import RenderedChart
from kubernetes import client

from .conftest import OPERATOR_NAMESPACE

ROUTER = "sluice-activator"  # the chart's router (activator) for release "sluice"
ITL_MS = 150
LONG_TOKENS = 400  # 60 s per long stream: longer than a new pod's start plus the preStop
STREAM_TIMEOUT = 120  # grace period = preStop 5 + drain 120 + margin 15
_DRAINING = re.compile(r"draining \(up to \S+ for (\d+) streams\)")


def _merge(base: dict, extra: dict) -> dict:
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = copy.deepcopy(v)
    return base


def sim_model(namespace: str, name: str, placement: dict, replicas: int = 1, **spec) -> dict:
    body = load_sample("simulator.yaml", namespace, new_name=name)
    s = body["spec"]
    s.pop("autoscaling", None)
    s["replicas"] = replicas
    s["engine"]["simulator"] = {"ttftMs": 50, "itlMs": ITL_MS, "ttftPerStreamMs": 0, "jitter": 0}
    s["resources"] = {**s["resources"], **copy.deepcopy(placement)}
    s["streaming"] = {"streamTimeoutSeconds": STREAM_TIMEOUT}
    s["ingress"] = {"enabled": True, "path": f"/{namespace}"}
    _merge(s, spec)
    return body


def ready_model(models, namespace: str, name: str, timeout: float = 120) -> dict:
    def ready():
        m = models.get(namespace, name)
        st = m.get("status") or {}
        return (st.get("phase") == "Ready"
                and st.get("observedGeneration") == m["metadata"]["generation"] and st)  # fmt: skip

    return eventually(ready, timeout=timeout, interval=0.5, message=f"{namespace}/{name} Ready")


def routed(ingress, core, namespace: str, name: str, count: int, timeout: float = 60,
           path: str | None = None, headers: dict | None = None) -> str:  # fmt: skip
    """The model's URL on the ingress (its path, `/<namespace>` unless given), once the
    ingress routes `count` endpoints to it and the model answers there."""
    url = f"{ingress.url}{path or '/' + namespace}"

    def has_all():
        eps = ready_endpoints(core, namespace, name)
        last = ingress.reloads[-1].endpoints if ingress.reloads else {}
        mine = [v for k, v in last.items() if k.startswith(namespace.replace("-", "_"))]
        return len(eps) == count and mine and len(mine[0]) == count

    eventually(
        has_all, timeout=timeout, interval=0.25, message=f"the ingress to route {count} pods"
    )
    eventually(lambda: httpx.get(f"{url}/v1/models", headers=headers, timeout=5).status_code
               == 200, timeout=30, message="the model to answer through the ingress")  # fmt: skip
    return url


def metrics_page(address: str) -> str:
    """The /metrics page of a pod or router at `address` (ip:port)."""
    return httpx.get(f"http://{address}/metrics", timeout=5).text


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples on a /metrics page, over those with `labels`."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        if key.split("{")[0] == name and all(w in key for w in want):
            total += float(value)
    return total


def live_pods(models, namespace: str, name: str) -> list[client.V1Pod]:
    return [p for p in models.pods(namespace, name) if p.metadata.deletion_timestamp is None]


def pod_ready(pod: client.V1Pod) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def drained_streams(node, namespace: str, pod: str) -> int | None:
    """How many streams the server said it was draining when SIGTERM came (its own log)."""
    log = node.log_dir / f"{namespace}.{pod}.server.log"
    found = _DRAINING.findall(log.read_text(errors="replace")) if log.exists() else []
    return int(found[-1]) if found else None


def served_by(node, namespace: str, pod: str) -> int:
    log = node.log_dir / f"{namespace}.{pod}.server.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    return text.count("outcome=finished")


def claim(core: client.CoreV1Api, namespace: str, name: str) -> None:
    """A PersistentVolume pre-bound to a claim, so the real PV controller binds them."""
    pv = f"{namespace}-{name}"
    core.create_persistent_volume({
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"],
                 "storageClassName": "e2e-local", "hostPath": {"path": "/var/empty"},
                 "claimRef": {"namespace": namespace, "name": name}},
    })  # fmt: skip
    core.create_namespaced_persistent_volume_claim(namespace, {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
        "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "e2e-local",
                 "volumeName": pv, "resources": {"requests": {"storage": "1Gi"}}},
    })  # fmt: skip
    eventually(lambda: core.read_namespaced_persistent_volume_claim(name, namespace).status.phase
             == "Bound", timeout=30, message=f"claim {name} Bound")  # fmt: skip


def rwx_claim(core: client.CoreV1Api, namespace: str, name: str) -> None:
    """A ReadWriteMany PersistentVolume pre-bound to the claim (the e2e cluster has no
    provisioner; the node agent gives every claim a host folder)."""
    pv = f"{namespace}-{name}"
    core.create_persistent_volume({
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"],
                 "storageClassName": "e2e-rwx", "hostPath": {"path": "/var/empty"},
                 "claimRef": {"namespace": namespace, "name": name}},
    })  # fmt: skip
    core.create_namespaced_persistent_volume_claim(namespace, {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
        "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "e2e-rwx",
                 "volumeName": pv, "resources": {"requests": {"storage": "1Gi"}}},
    })  # fmt: skip
    eventually(lambda: core.read_namespaced_persistent_volume_claim(name, namespace).status.phase
               == "Bound", timeout=30, message=f"claim {name} Bound")  # fmt: skip


def sse_tokens(text: str) -> tuple[int, str | None, bool]:
    """(completion tokens the final event's usage counts, finish reason, [DONE] seen)."""
    n, reason = 0, None
    for line in text.splitlines():
        if line.startswith("data: {"):
            ev = json.loads(line[6:])
            if "choices" in ev:  # an OpenAI chunk
                for choice in ev["choices"]:
                    reason = choice.get("finish_reason") or reason
            elif ev.get("finished"):
                reason = ev.get("finish_reason")
            if ev.get("usage"):
                n = ev["usage"].get("completion_tokens", n)
    return n, reason, "data: [DONE]" in text


def access_records(node, namespace: str, pod: str) -> list[dict]:
    """The server's access-log records (`<date> <time> access k=v ...`), with `at`: the
    line's own timestamp (time.time())."""
    log = node.log_dir / f"{namespace}.{pod}.server.log"
    out = []
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        day, clock, kind, *fields = [*line.split(" "), "", ""][:3] + line.split(" ")[3:]
        if kind != "access":
            continue
        rec: dict = dict(f.split("=", 1) for f in fields if "=" in f)
        for k in ("status", "completion_tokens"):
            rec[k] = int(rec.get(k, -1))
        rec["at"] = datetime.strptime(f"{day} {clock}", "%Y-%m-%d %H:%M:%S,%f").timestamp()
        out.append(rec)
    return out


def by_request(node, namespace: str, pods: list[str]) -> dict[str, list[tuple[str, dict]]]:
    """request id -> [(pod, access record), ...] over the model's pods."""
    out: dict[str, list[tuple[str, dict]]] = {}
    for pod in pods:
        for rec in access_records(node, namespace, pod):
            out.setdefault(rec.get("request_id"), []).append((pod, rec))
    return out


def router_manifests(chart: RenderedChart, placement: dict, replicas: int,
                     **pod_spec) -> tuple[dict, dict, list[dict]]:  # fmt: skip
    """The chart's router Deployment (`replicas` on the live node, `pod_spec` over its pod
    spec, `--host=0.0.0.0` said out loud: the node agent binds a wildcard given in the
    arguments to the pod's own address), Service and Secrets (pin key, continuation key)."""
    (dep,) = [copy.deepcopy(d) for d in chart.of_kind("Deployment")
              if d["metadata"]["name"] == ROUTER]  # fmt: skip
    (svc,) = [copy.deepcopy(s) for s in chart.of_kind("Service")
              if s["metadata"]["name"] == ROUTER]  # fmt: skip
    keys = [copy.deepcopy(s) for s in chart.of_kind("Secret")
            if s["metadata"]["name"] in (f"{ROUTER}-pin-key", f"{ROUTER}-continuation-key")]  # fmt: skip
    dep["spec"]["replicas"] = replicas
    pod = dep["spec"]["template"]["spec"]
    pod.update(copy.deepcopy(placement))
    pod.update(copy.deepcopy(pod_spec))
    pod["containers"][0]["args"].append("--host=0.0.0.0")
    return dep, svc, keys


class LiveRouter:
    """The chart's router on the live node, made by `start` and removed by `close` (its
    pods gone); `roll` re-renders its Deployment from other chart values."""

    def __init__(self, admin: client.ApiClient, chart: RenderedChart) -> None:
        self.apps, self.core = client.AppsV1Api(admin), client.CoreV1Api(admin)
        self.chart = chart
        self.made: list[tuple[str, str]] = []
        self.endpoints: list[Endpoint] = []

    def ready(self, replicas: int, exclude: Collection[str] = ()) -> list[Endpoint]:
        def all_ready():
            eps = ready_endpoints(self.core, OPERATOR_NAMESPACE, ROUTER)
            fresh = len(eps) == replicas and {e.pod for e in eps}.isdisjoint(exclude)
            return fresh and sorted(eps)

        self.endpoints = eventually(all_ready, timeout=180, interval=0.5,
                                    message=f"{replicas} router pods Ready")  # fmt: skip
        return self.endpoints

    def start(self, placement: dict, replicas: int = 1, **pod_spec) -> list[Endpoint]:
        """Its Secret, Service and Deployment; its Ready pods' endpoints."""
        dep, svc, keys = router_manifests(self.chart, placement, replicas, **pod_spec)
        for key in keys:
            self.core.create_namespaced_secret(OPERATOR_NAMESPACE, key)
            self.made.append(("secret", key["metadata"]["name"]))
        self.core.create_namespaced_service(OPERATOR_NAMESPACE, svc)
        self.made.append(("svc", ROUTER))
        self.apps.create_namespaced_deployment(OPERATOR_NAMESPACE, dep)
        self.made.append(("dep", ROUTER))
        return self.ready(replicas)

    def roll(self, values: dict[str, str], placement: dict) -> Endpoint:
        """`helm upgrade --set values` for a one-pod router: its Deployment's new pod
        template, rolled by the Deployment controller; the old pod gone."""
        (old,) = self.endpoints
        dep, _, _ = router_manifests(
            RenderedChart.render(OPERATOR_NAMESPACE, values=values), placement, 1
        )
        self.apps.patch_namespaced_deployment(ROUTER, OPERATOR_NAMESPACE, {"spec": {"template": {
            "spec": {"containers": dep["spec"]["template"]["spec"]["containers"]}}}})  # fmt: skip
        (new,) = self.ready(1, exclude={old.pod})
        self.gone({old.pod})
        return new

    def gone(self, pods: set[str] | None = None) -> None:
        """Wait until these pods (None: every router pod) are deleted."""

        def left() -> bool:
            names = [
                p.metadata.name for p in self.core.list_namespaced_pod(OPERATOR_NAMESPACE).items
            ]
            return not [n for n in names if (n in pods if pods else n.startswith(f"{ROUTER}-"))]

        eventually(left, timeout=120, interval=0.5, message="the router pods gone")

    def close(self) -> None:
        for kind, name in reversed(self.made):
            if kind == "dep":
                self.apps.delete_namespaced_deployment(name, OPERATOR_NAMESPACE)
            elif kind == "secret":
                self.core.delete_namespaced_secret(name, OPERATOR_NAMESPACE)
            else:
                self.core.delete_namespaced_service(name, OPERATOR_NAMESPACE)
        if self.made:
            self.gone()
