"""The LeaderWorkerSet (leaderworkerset.x-k8s.io/v1, LWS v0.10) of a model on several nodes.

With `spec.parallelism.nodes > 1` a replica is a group of `nodes` pods, one per node: the
leader is the Deployment's pod (the server, its probes and drain) whose vLLM engine is rank
0 of vLLM's multiprocessing multi-node backend; each worker runs the same server command with
its own rank, which makes the server start vLLM's headless workers only (no HTTP port, no
probes: a worker is ready when it runs, and the group is ready when the leader's `/ready`
says its engine, which needs every worker, is up).

- `startupPolicy: LeaderCreated`: the workers start with the leader, not after it is Ready;
  the leader cannot become Ready before its workers have joined (LeaderReady would wait
  forever).
- `restartPolicy: RecreateGroupOnPodRestart`: a group with a dead worker cannot serve, so
  any failed pod recreates the whole group.
- Rolling update one group at a time: `maxSurge` / `maxUnavailable` are the spec's rollout
  (default surge 1 group, none unavailable), as with the Deployment.
- Workers keep running while the leader drains: their preStop waits the leader's preStop and
  drain, so in-flight streams finish before the engine's workers exit.
- `parallelism.exclusiveTopologyKey`: LWS exclusive placement, one group per value of that
  node label.
"""

from __future__ import annotations

import copy
from typing import Any

from ..models.resource import StreamingModel
from .args import PRESTOP_SECONDS, drain_seconds, worker_args
from .common import endpoint_picker_labels, metadata
from .continuation import CONTINUATION_VOLUME
from .deployment import pod_template
from .secrets import REDIS_URL_ENV, REDIS_VOLUME

API_VERSION = "leaderworkerset.x-k8s.io/v1"
KIND = "LeaderWorkerSet"
EXCLUSIVE_TOPOLOGY = "leaderworkerset.sigs.k8s.io/exclusive-topology"
ROLE_LABEL = "serving.sluice.dev/role"


def leader_selector(model: StreamingModel) -> dict[str, str]:
    """Labels that pick a group's leader (the pod with the HTTP API), empty for one node."""
    return {ROLE_LABEL: "leader"} if model.multi_node else {}


def _worker_template(model: StreamingModel, leader: dict[str, Any]) -> dict[str, Any]:
    worker = copy.deepcopy(leader)
    labels = worker["metadata"]["labels"]
    labels[ROLE_LABEL] = "worker"
    # An endpoint picker reads leaders only (the pool selects them): the operator's EPP
    # labels stay off workers (podLabels do not).
    for key in endpoint_picker_labels(model).keys() - model.spec.pod_labels.keys():
        del labels[key]
    # Nothing to scrape or probe: the worker serves no HTTP.
    worker["metadata"]["annotations"] = dict(model.spec.pod_annotations)
    (container,) = worker["spec"]["containers"]
    container["name"] = "engine-worker"
    container["args"] = worker_args(model)
    for key in ("ports", "startupProbe", "readinessProbe", "livenessProbe"):
        container.pop(key)
    # Nor rate limits, nor continuations: the Redis URL and the continuation key stay on
    # the leader.
    container["env"] = [e for e in container["env"] if e["name"] != REDIS_URL_ENV]
    leader_only = (REDIS_VOLUME, CONTINUATION_VOLUME)
    container["volumeMounts"] = [
        m for m in container["volumeMounts"] if m["name"] not in leader_only
    ]
    pod = worker["spec"]
    pod["volumes"] = [v for v in pod["volumes"] if v["name"] not in leader_only]
    wait = PRESTOP_SECONDS + drain_seconds(model)
    container["lifecycle"] = {"preStop": {"sleep": {"seconds": wait}}}
    return worker


def desired_leaderworkerset(model: StreamingModel) -> dict[str, Any] | None:
    """None with one node per replica (a Deployment runs it)."""
    if not model.multi_node:
        return None
    spec = model.spec
    leader = pod_template(model)
    leader["metadata"]["labels"][ROLE_LABEL] = "leader"
    lws_spec: dict[str, Any] = {
        "startupPolicy": "LeaderCreated",
        "rolloutStrategy": {
            "type": "RollingUpdate",
            "rollingUpdateConfiguration": {
                "maxSurge": spec.rollout.max_surge,
                "maxUnavailable": spec.rollout.max_unavailable,
            },
        },
        "leaderWorkerTemplate": {
            "size": spec.parallelism.nodes,
            "restartPolicy": "RecreateGroupOnPodRestart",
            "leaderTemplate": leader,
            "workerTemplate": _worker_template(model, leader),
        },
    }
    # With autoscaling the HPA owns .spec.replicas (groups), as with the Deployment.
    if not spec.autoscaling_enabled:
        lws_spec["replicas"] = spec.replicas
    meta = metadata(model)
    key = spec.parallelism.exclusive_topology_key
    if key:
        meta["annotations"] = {EXCLUSIVE_TOPOLOGY: key}
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": meta, "spec": lws_spec}


def scale_target(model: StreamingModel) -> dict[str, str]:
    """What an HPA or KEDA scales: the Deployment, or the LeaderWorkerSet (groups)."""
    if model.multi_node:
        return {"apiVersion": API_VERSION, "kind": KIND, "name": model.name}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": model.name}
