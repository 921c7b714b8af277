"""Shared pieces of the live-pod scenarios (test_live_pods.py, test_live_engine.py,
test_live_adapters.py): the simulator model they deploy, a bound claim for real weights,
waiting for a model and for the ingress to route it, reading what the node agent and the
servers recorded and what a stream said."""

from __future__ import annotations

import copy
import json
import re

import httpx
from e2e_harness.endpoints import ready_endpoints
from e2e_harness.kube import eventually, load_sample
from kubernetes import client

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
