"""Shared pieces of the live-pod scenarios (test_live_pods.py, test_live_engine.py): the
simulator model they deploy, waiting for a model and for the ingress to route it, reading
what the node agent and the servers recorded."""

from __future__ import annotations

import copy
import re

import httpx
from kubernetes import client

from .harness.endpoints import ready_endpoints
from .harness.kube import eventually, load_sample

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
