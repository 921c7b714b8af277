"""Rollouts that keep serving, on the real Deployment controller and scheduler.

Each test brings its own tainted fake GPU node (so other tests' pods stay off it) whose fake
kubelet keeps a new pod Running but not Ready for a few seconds, like a server loading its
model; the StreamingModel selects and tolerates that node. Ready replicas are sampled from
the Deployment every 100 ms while a spec change of a one-replica model rolls out.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from e2e_harness.kube import eventually, load_sample
from e2e_harness.node_agent import NodeAgent
from kubernetes import client

from .conftest import TIMINGS

LOAD_SECONDS = 3.0


@pytest.fixture
def own_node(admin, namespace):
    """(node, the StreamingModel placement that puts pods on it and only there)."""
    created: list[NodeAgent] = []
    core = client.CoreV1Api(admin)

    def make(gpus: int) -> tuple[NodeAgent, dict]:
        name = f"rollout-{uuid.uuid4().hex[:6]}"
        taint = {"key": "sluice.dev/e2e-node", "value": name, "effect": "NoSchedule"}
        node = NodeAgent(
            admin,
            name,
            gpus=gpus,
            ready_after=LOAD_SECONDS,
            taint=taint,
            labels={"sluice.dev/e2e-node": name},
        ).start()
        created.append(node)

        def only_our_taint():
            taints = core.read_node(name).spec.taints or []
            return all(t.key == "sluice.dev/e2e-node" for t in taints)

        eventually(only_our_taint, timeout=30, message=f"{name} to lose its not-ready taint")
        placement = {
            "nodeSelector": {"sluice.dev/e2e-node": name},
            "tolerations": [
                {
                    "key": "sluice.dev/e2e-node",
                    "operator": "Equal",
                    "value": name,
                    "effect": "NoSchedule",
                }
            ],
        }
        return node, placement

    yield make
    for node in created:
        node.stop()


def _model(namespace: str, placement: dict, rollout: dict | None = None) -> dict:
    body = load_sample("chat-small.yaml", namespace, new_name="roll")
    body["spec"]["replicas"] = 1
    body["spec"]["resources"] = {"gpus": 1, **placement}
    body["spec"]["parallelism"] = {"tensor": 1}
    body["spec"].pop("autoscaling", None)
    if rollout is not None:
        body["spec"]["rollout"] = rollout
    return body


def _ready_model(models, namespace: str, name: str) -> dict:
    def ready():
        model = models.get(namespace, name)
        status = model.get("status") or {}
        return (
            status.get("phase") == "Ready"
            and status.get("observedGeneration") == model["metadata"]["generation"]
            and status
        )

    return eventually(ready, timeout=60, message=f"{namespace}/{name} Ready")


def _rollout_min_ready(models, namespace: str, name: str, change: dict) -> tuple[int, int]:
    """Apply `change`, sample the Deployment's readyReplicas every 100 ms until the new pod
    serves alone; (minimum ready, samples)."""
    samples: list[int] = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            dep = models.apps.read_namespaced_deployment(name, namespace)
            samples.append(dep.status.ready_replicas or 0)
            stop.wait(0.1)

    old = {p.metadata.name for p in models.pods(namespace, name)}
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        models.patch(namespace, name, {"spec": change})

        def done():
            dep = models.apps.read_namespaced_deployment(name, namespace)
            pods = {
                p.metadata.name
                for p in models.pods(namespace, name)
                if p.metadata.deletion_timestamp is None
            }
            st = dep.status
            return (
                st.observed_generation == dep.metadata.generation
                and st.updated_replicas == 1
                and st.ready_replicas == 1
                and (st.replicas or 0) == 1
                and pods
                and not pods & old
            )

        eventually(done, timeout=60, message="the rollout to finish")
        time.sleep(0.3)
    finally:
        stop.set()
        sampler.join(timeout=5)
    return min(samples), len(samples)


def test_one_replica_rollout_never_drops_to_zero_ready(operator, models, namespace, own_node):
    _, placement = own_node(gpus=2)
    body = _model(namespace, placement)
    models.create(body)
    _ready_model(models, namespace, "roll")
    minimum, n = _rollout_min_ready(models, namespace, "roll", {"engine": {"maxNumSeqs": 64}})
    TIMINGS["one-replica rollout, default surge: min ready replicas (100 ms samples)"] = (
        f"{minimum} (n={n})"
    )
    assert n >= LOAD_SECONDS * 5  # sampled through the new pod's load time
    assert minimum >= 1


def test_in_place_rollout_drops_to_zero(operator, models, namespace, own_node):
    """maxSurge 0 / maxUnavailable 1 (in place, for full clusters) works, and is the negative
    control of the sampler: the one replica is gone while the new pod loads."""
    _, placement = own_node(gpus=1)
    body = _model(namespace, placement, rollout={"maxSurge": 0, "maxUnavailable": 1})
    models.create(body)
    _ready_model(models, namespace, "roll")
    minimum, n = _rollout_min_ready(models, namespace, "roll", {"engine": {"maxNumSeqs": 64}})
    TIMINGS["one-replica rollout, maxSurge 0: min ready replicas (100 ms samples)"] = (
        f"{minimum} (n={n})"
    )
    assert minimum == 0
    _ready_model(models, namespace, "roll")


def test_full_node_rollout_waits_and_status_says_why(operator, models, namespace, own_node):
    _, placement = own_node(gpus=1)  # room for the one pod, none for a surge pod
    models.create(_model(namespace, placement))
    _ready_model(models, namespace, "roll")
    models.patch(namespace, "roll", {"spec": {"engine": {"maxNumSeqs": 64}}})

    def waiting():
        status = models.get(namespace, "roll").get("status") or {}
        conds = {c["type"]: c for c in status.get("conditions") or []}
        return conds.get("Progressing", {}).get("reason") == "SurgePodUnschedulable" and status

    status = eventually(
        waiting, timeout=30, message="status to say the surge pod cannot be scheduled"
    )
    assert status["phase"] == "Progressing" and status["readyReplicas"] == 1
    assert "Insufficient nvidia.com/gpu" in status["message"], status["message"]
    assert "maxSurge: 0" in status["message"]
    time.sleep(3)  # it keeps waiting: the old pod still serves
    assert models.apps.read_namespaced_deployment("roll", namespace).status.ready_replicas == 1

    # The documented way out on a full cluster: replace in place.
    models.patch(namespace, "roll", {"spec": {"rollout": {"maxSurge": 0, "maxUnavailable": 1}}})
    status = _ready_model(models, namespace, "roll")
    assert "cannot be scheduled" not in status["message"]
