"""Status mapping: Deployment (and pods, Ingress) -> phase, conditions, URL, endpoints."""

from __future__ import annotations

import re

import pytest
from operator_helpers import minimal
from sluice_operator.models.status import CONDITION_TYPES, StreamingModelStatus
from sluice_operator.status_from_cluster import compute_status, invalid_status
from sluice_operator.validation import load_model

NOW = "2026-11-30T06:00:00Z"


def model(**spec):
    return load_model(minimal(**spec))


def deployment(
    replicas=2, ready=0, updated=None, current=None, generation=1, observed=1, progressing=None
):
    status = {
        "observedGeneration": observed,
        "replicas": replicas if current is None else current,
        "readyReplicas": ready,
        "updatedReplicas": replicas if updated is None else updated,
    }
    if progressing:
        status["conditions"] = [{"type": "Progressing", **progressing}]
    return {
        "metadata": {"generation": generation},
        "spec": {"replicas": replicas},
        "status": status,
    }


def pending_pod(message="0/3 nodes are available: 3 Insufficient nvidia.com/gpu."):
    return {
        "metadata": {"name": "m-abc"},
        "status": {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": message,
                }
            ],
        },
    }


def crashing_pod():
    return {
        "metadata": {"name": "m-xyz"},
        "status": {
            "containerStatuses": [
                {
                    "state": {
                        "waiting": {
                            "reason": "CrashLoopBackOff",
                            "message": "back-off 5m0s restarting",
                        }
                    }
                }
            ]
        },
    }


def conds(status):
    return {c["type"]: c for c in status["conditions"]}


@pytest.mark.parametrize(
    "dep,pods,phase,ready,available,progressing",
    [
        (deployment(ready=2), [], "Ready", "True", "True", "False"),
        (deployment(ready=1), [], "Degraded", "False", "True", "False"),
        (deployment(ready=0), [], "Progressing", "False", "False", "True"),
        (deployment(ready=1, updated=1), [], "Progressing", "False", "True", "True"),
        (deployment(ready=2, generation=2, observed=1), [], "Progressing", "False", "True", "True"),
        (deployment(ready=2, current=3), [], "Progressing", "False", "True", "True"),
        (deployment(ready=0), [pending_pod()], "Pending", "False", "False", "True"),
        (deployment(ready=1), [pending_pod()], "Degraded", "False", "True", "False"),
        (deployment(ready=0), [crashing_pod()], "Failed", "False", "False", "False"),
        (
            deployment(
                ready=0,
                progressing={
                    "status": "False",
                    "reason": "ProgressDeadlineExceeded",
                    "message": "x",
                },
            ),
            [],
            "Failed",
            "False",
            "False",
            "False",
        ),
        (deployment(replicas=0, ready=0), [], "Pending", "False", "False", "False"),
    ],
    ids=[
        "all-ready",
        "some-ready",
        "starting",
        "rolling-out",
        "new-generation-unseen",
        "old-pod-terminating",
        "no-gpus",
        "no-gpus-some-ready",
        "crashloop",
        "deadline",
        "scaled-to-zero",
    ],
)
def test_phase_and_conditions(dep, pods, phase, ready, available, progressing):
    status = compute_status(model(replicas=dep["spec"]["replicas"]), 1, dep, pods, None, None, NOW)
    c = conds(status)
    assert status["phase"] == phase, status["message"]
    assert (c["Ready"]["status"], c["Available"]["status"], c["Progressing"]["status"]) == (
        ready,
        available,
        progressing,
    ), status
    assert c["SpecValid"]["status"] == "True"
    for cond in c.values():
        assert cond["reason"] and cond["message"] and cond["lastTransitionTime"] == NOW
        assert cond["observedGeneration"] == 1
    StreamingModelStatus.model_validate(status)  # fits the CRD's status schema


def test_unschedulable_message_is_in_status():
    status = compute_status(model(), 1, deployment(ready=0), [pending_pod()], None, None, NOW)
    assert "Insufficient nvidia.com/gpu" in status["message"]
    assert "Insufficient nvidia.com/gpu" in conds(status)["Ready"]["message"]


def test_counts_selector_url_and_endpoints():
    status = compute_status(model(), 3, deployment(ready=1), [], None, None, NOW)
    assert (status["replicas"], status["readyReplicas"], status["ready"]) == (2, 1, "1/2")
    assert status["observedGeneration"] == 3
    assert status["selector"] == "app.kubernetes.io/name=sluice-server,app.kubernetes.io/instance=m"
    assert status["url"] == "http://m.default.svc:8000"
    assert status["endpoints"] == {
        "openai": "http://m.default.svc:8000/v1",
        "sse": "http://m.default.svc:8000/v1/stream",
        "websocket": "ws://m.default.svc:8000/ws/stream",
        "responses": "http://m.default.svc:8000/v1/responses",
        "anthropic": "http://m.default.svc:8000/v1/messages",
    }


def test_ingress_url_with_tls_and_websocket_only():
    m = model(
        streaming={"protocols": ["websocket"]},
        ingress={"enabled": True, "host": "a.example.com", "path": "/x/", "tlsSecretName": "t"},
    )
    status = compute_status(m, 1, deployment(ready=2), [], None, None, NOW)
    assert status["url"] == "https://a.example.com/x"
    assert status["endpoints"] == {"websocket": "wss://a.example.com/x/ws/stream"}


def test_ingress_without_host_uses_load_balancer_address():
    m = model(ingress={"enabled": True})
    ing = {"status": {"loadBalancer": {"ingress": [{"ip": "203.0.113.7"}]}}}
    status = compute_status(m, 1, deployment(ready=2), [], ing, None, NOW)
    assert status["url"] == "http://203.0.113.7"


def test_missing_deployment_is_pending():
    status = compute_status(model(replicas=2), 1, None, [], None, None, NOW)
    assert status["phase"] == "Pending" and status["ready"] == "0/2"
    assert conds(status)["Progressing"]["reason"] == "Creating"


def test_last_transition_time_kept_when_status_unchanged():
    first = compute_status(model(), 1, deployment(ready=1), [], None, None, NOW)
    later = "2026-11-30T07:00:00Z"
    second = compute_status(model(), 1, deployment(ready=1), [], None, first, later)
    assert second == first  # nothing changed: nothing to write
    third = compute_status(model(), 1, deployment(ready=2), [], None, second, later)
    c = conds(third)
    assert c["Ready"]["lastTransitionTime"] == later and c["SpecValid"]["lastTransitionTime"] == NOW


def test_invalid_status_keeps_pod_conditions():
    running = compute_status(model(), 1, deployment(ready=2), [], None, None, NOW)
    status = invalid_status("spec.x: bad", 2, running, NOW)
    c = conds(status)
    assert status["phase"] == "Failed" and c["SpecValid"]["status"] == "False"
    assert c["Available"]["status"] == "True"  # the old pods still serve
    assert c["SpecValid"]["observedGeneration"] == 2
    StreamingModelStatus.model_validate(status)


def hpa_status(current="250m", conditions=()):
    return {
        "status": {
            "currentReplicas": 2,
            "desiredReplicas": 3,
            "lastScaleTime": "2026-11-30T06:00:00Z",
            "currentMetrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": "sluice_ttft_p90_seconds"},
                        "current": {"averageValue": current},
                    },
                }
            ],
            "conditions": list(conditions),
        }
    }


@pytest.mark.parametrize(
    "value,ms", [("250m", 250), ("1", 1000), ("1500m", 1500), ("0", 0), (None, None), ("x", None)]
)
def test_quantity_seconds_to_ms(value, ms):
    from sluice_operator.status_from_cluster import quantity_seconds_to_ms

    assert quantity_seconds_to_ms(value) == ms


def test_autoscaling_status_from_hpa():
    m = model(autoscaling={"minReplicas": 1, "maxReplicas": 4, "targetTTFTMilliseconds": 500})
    status = compute_status(m, 1, deployment(ready=2), [], None, None, NOW, hpa=hpa_status())
    assert status["autoscaling"] == {
        "backend": "hpa",
        "metric": "sluice_ttft_p90_seconds",
        "targetTTFTMilliseconds": 500,
        "currentTTFTMilliseconds": 250,
        "currentReplicas": 2,
        "desiredReplicas": 3,
        "lastScaleTime": "2026-11-30T06:00:00Z",
    }
    StreamingModelStatus.model_validate(status)


def test_autoscaling_status_from_kedas_hpa():
    """backend keda: KEDA's HPA reads the trigger as an External metric whose averageValue
    is the same per-pod average; a Pods metric of the same name there is not ours."""
    m = model(autoscaling={"backend": "keda", "maxReplicas": 4, "targetTTFTMilliseconds": 500})
    keda_hpa = hpa_status()
    keda_hpa["status"]["currentMetrics"] = [
        {
            "type": "External",
            "external": {
                "metric": {"name": "s0-prometheus", "selector": {"matchLabels": {}}},
                "current": {"averageValue": "750m"},
            },
        }
    ]
    status = compute_status(m, 1, deployment(ready=2), [], None, None, NOW, hpa=keda_hpa)
    assert status["autoscaling"]["backend"] == "keda"
    assert status["autoscaling"]["currentTTFTMilliseconds"] == 750
    assert status["autoscaling"]["desiredReplicas"] == 3
    StreamingModelStatus.model_validate(status)
    # The HPA-backend reading (a Pods metric) is not taken for a keda model, nor vice versa.
    status = compute_status(m, 1, deployment(ready=2), [], None, None, NOW, hpa=hpa_status())
    assert "currentTTFTMilliseconds" not in status["autoscaling"]
    m = model(autoscaling={"maxReplicas": 4})
    status = compute_status(m, 1, deployment(ready=2), [], None, None, NOW, hpa=keda_hpa)
    assert "currentTTFTMilliseconds" not in status["autoscaling"]


def test_autoscaling_status_says_why_the_metric_is_missing():
    m = model(autoscaling={"maxReplicas": 4})
    cond = {
        "type": "ScalingActive",
        "status": "False",
        "reason": "FailedGetPodsMetric",
        "message": "the HPA was unable to compute the replica count: unable to get metric sluice_ttft_p90_seconds",
    }
    hpa = {"status": {"currentReplicas": 1, "desiredReplicas": 1, "conditions": [cond]}}
    status = compute_status(m, 1, deployment(replicas=1, ready=1), [], None, None, NOW, hpa=hpa)
    assert "unable to get metric sluice_ttft_p90_seconds" in status["autoscaling"]["message"]
    assert "currentTTFTMilliseconds" not in status["autoscaling"]


def test_no_autoscaling_status_without_autoscaling():
    assert "autoscaling" not in compute_status(model(), 1, deployment(ready=2), [], None, None, NOW)


def test_surge_pod_without_room_says_why_while_old_pods_serve():
    # One replica rolling out with maxSurge 1: the old pod is ready, the new one is Pending.
    dep = deployment(replicas=1, ready=1, updated=0, current=2, generation=2, observed=2)
    status = compute_status(model(replicas=1), 2, dep, [pending_pod()], None, None, NOW)
    c = conds(status)
    assert status["phase"] == "Progressing" and status["readyReplicas"] == 1
    assert "cannot be scheduled" in status["message"]
    assert "0/3 nodes are available: 3 Insufficient nvidia.com/gpu" in status["message"]
    assert "maxSurge: 0" in status["message"]  # what to do on a full cluster
    assert c["Progressing"]["reason"] == "SurgePodUnschedulable"
    assert c["Available"]["status"] == "True" and c["Ready"]["status"] == "False"
    StreamingModelStatus.model_validate(status)


def test_surge_waiting_needs_the_old_replicas_ready():
    # Negative control: nothing ready and a Pending pod is the plain "no GPUs" case.
    dep = deployment(replicas=1, ready=0, updated=0, current=2, generation=2, observed=2)
    status = compute_status(model(replicas=1), 2, dep, [pending_pod()], None, None, NOW)
    assert status["phase"] == "Pending"
    assert conds(status)["Progressing"]["reason"] != "SurgePodUnschedulable"


def test_the_api_reference_names_every_condition_type():
    """status.conditions' description (kubectl explain, docs/api.md) says when each condition
    the operator writes appears; mypy holds the writers to CONDITION_TYPES."""
    text = StreamingModelStatus.model_fields["conditions"].description or ""
    assert [t for t in CONDITION_TYPES if not re.search(rf"\b{t}\b", text)] == []
