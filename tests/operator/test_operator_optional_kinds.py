"""The optional kinds (`kinds.OPTIONAL_KINDS`: KEDA's ScaledObject, the HTTPRoute, the
PodMonitor, the LeaderWorkerSet), each row run through the same pass: a cluster that lacks the kind's CRD (404)
or the grant (403) gets the rest of the model, the row's message in the status, one Warning
Event and a retried pass; once installed the kind converges. A row added to the table is
run here too, once `WANTS` says which spec asks for it."""

from __future__ import annotations

import pytest
from kubernetes.client.exceptions import ApiException
from operator_helpers import AbsentKind, Events, body_of, minimal, with_status
from sluice_operator.kinds import (
    CHILD_KINDS,
    DEPLOYMENT,
    OPTIONAL_KINDS,
    WATCHED_KINDS,
    OptionalKind,
)
from sluice_operator.reconcile import converge
from sluice_operator.status_from_cluster import reported

NOW = "2026-11-30T06:00:00Z"

# kind -> the spec that asks for it.
WANTS = {
    "ScaledObject": {"autoscaling": {"backend": "keda", "maxReplicas": 3}},
    "HTTPRoute": {"gateway": {"parentRefs": [{"name": "public"}]}},
    "PodMonitor": {"observability": {"podMonitor": {"enabled": True}}},
    "InferencePool": {"routing": {"inferencePool": {"enabled": True}}},
    "LeaderWorkerSet": {"parallelism": {"pipeline": 2, "nodes": 2}},
}
ROWS = [pytest.param(o, id=o.name) for o in OPTIONAL_KINDS]


def test_every_row_has_a_spec_that_wants_it_and_none_is_watched():
    assert sorted(WANTS) == sorted(o.name for o in OPTIONAL_KINDS)
    for row in OPTIONAL_KINDS:
        assert row.kind not in WATCHED_KINDS and row.kind.optional
        assert row.excludes is None or row.excludes in CHILD_KINDS
        assert (row.condition is None) == (row.ready is None)
        assert row.forbidden != row.missing


@pytest.mark.parametrize("refuse", [404, 403])
@pytest.mark.parametrize("row", ROWS)
def test_refused_kind_is_reported_the_rest_converges_and_it_is_retried(
    row: OptionalKind, refuse: int
):
    cluster = AbsentKind(row.name, refuse)
    body = body_of(minimal(**WANTS[row.name]))
    events = Events()
    with pytest.raises(ApiException) as info:
        converge(cluster, body, events, now=NOW)
    assert info.value.status == refuse
    # The rest converges; a kind that replaces the Deployment (the LeaderWorkerSet) leaves none.
    workload = set() if row.excludes is DEPLOYMENT else {"Deployment"}
    assert {"Service", *workload} <= {k[0] for k in cluster.objects}
    message = row.forbidden if refuse == 403 else row.missing
    assert reported(row, cluster.statuses[-1]) == message
    assert [e for e in events if e[0] == "Warning"] == [("Warning", row.event, message)]
    # The retry: the same refusal, no second Event, no status write.
    events.clear()
    cluster.calls.clear()
    with pytest.raises(ApiException):
        converge(cluster, with_status(body, cluster), events, now=NOW)
    assert events == [] and ("patch_status", "StreamingModel") not in cluster.calls
    # Installed: the kind is applied and the status no longer says it is missing.
    cluster.refuse = 0
    converge(cluster, with_status(body, cluster), Events(), now=NOW)
    assert (row.name, "default", "m") in cluster.objects
    assert reported(row, cluster.statuses[-1]) != message


@pytest.mark.parametrize("row", ROWS)
def test_a_kind_no_longer_wanted_is_let_go_unless_it_excludes_another(row: OptionalKind):
    """Turned off while the cluster refuses it: only a kind that would fight a child (KEDA's
    HPA and ours) keeps being reported and retried; the others are forgotten."""
    cluster = AbsentKind(row.name, 0)
    body = body_of(minimal(**WANTS[row.name]))
    converge(cluster, body, Events(), now=NOW)
    body = with_status(body, cluster)
    body["spec"] = minimal()["spec"]
    cluster.refuse = 403
    events = Events()
    if row.excludes is None:
        converge(cluster, body, events, now=NOW)
        assert not [e for e in events if e[0] == "Warning"]
        body = with_status(body, cluster)
        cluster.calls.clear()
        converge(cluster, body, Events(), now=NOW)
        assert not [c for c in cluster.calls if c[1] == row.name]
    else:
        with pytest.raises(ApiException):
            converge(cluster, body, events, now=NOW)
        assert [e[1] for e in events if e[0] == "Warning"] == [row.event]
        assert reported(row, cluster.statuses[-1]) == row.forbidden


def test_several_refused_kinds_each_get_their_event_and_the_first_is_raised():
    kinds = tuple(o.name for o in OPTIONAL_KINDS)
    cluster = AbsentKind(kinds, 404)
    body = body_of(minimal(**{k: v for want in WANTS.values() for k, v in want.items()}))
    events = Events()
    with pytest.raises(ApiException) as info:
        converge(cluster, body, events, now=NOW)
    assert (info.value.status, info.value.reason) == (404, "ScaledObject refused by the test")
    assert [e[1] for e in events if e[0] == "Warning"] == [o.event for o in OPTIONAL_KINDS]
    for row in OPTIONAL_KINDS:
        assert reported(row, cluster.statuses[-1]) == row.missing
    events.clear()
    with pytest.raises(ApiException):
        converge(cluster, with_status(body, cluster), events, now=NOW)
    assert events == []
