"""Converging reconcile and the kopf handlers, against a fake API server that counts calls."""

from __future__ import annotations

import logging

import kopf
import pytest
from kubernetes.client.exceptions import ApiException
from operator_helpers import (
    Events,
    FakeCluster,
    body_of,
    merge_patch,
    minimal,
    runtime_for,
    with_status,
)
from sluice_operator import handlers, passes
from sluice_operator.reconcile import HASH_ANNOTATION, contains, converge
from sluice_operator.validation import SpecError
from testkit.repo import ROOT
from testkit.wait import eventually

LOG = logging.getLogger("test")
NOW = "2026-11-30T06:00:00Z"


@pytest.fixture
def cluster():
    return FakeCluster()


def test_create_applies_every_child_with_owner_and_hash(cluster):
    body = body_of(ROOT / "samples/llama-70b-tp4.yaml")
    events = Events()
    out = converge(cluster, body, events, now=NOW)
    assert out.applied == [
        "Service",
        "Deployment",
        "Ingress",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
    ]
    for (_kind, ns, name), obj in cluster.objects.items():
        assert (ns, name) == ("models", "llama-70b")
        (ref,) = obj["metadata"]["ownerReferences"]
        assert (
            ref["uid"] == "uid-1" and ref["controller"] is True and ref["kind"] == "StreamingModel"
        )
        assert HASH_ANNOTATION in obj["metadata"]["annotations"]
    assert events == [("Normal", "Reconciled", "applied " + ", ".join(out.applied))]
    (status,) = cluster.status_patches
    assert status["phase"] == "Progressing" and status["observedGeneration"] == 1


def test_noop_resync_makes_no_write_calls(cluster):
    body = body_of(ROOT / "samples/llama-70b-tp4.yaml")
    converge(cluster, body, Events(), now=NOW)
    body = with_status(body, cluster)
    cluster.calls.clear()
    events = Events()
    for _ in range(3):
        out = converge(cluster, body, events, now="2026-11-30T07:00:00Z")
        assert not out.applied and not out.deleted and not out.status_written
    assert cluster.writes() == [] and events == []
    assert {verb for verb, _ in cluster.calls} <= {"get", "list"}


def test_noop_counting_has_teeth(cluster):
    # Negative control: the same resync after a hand edit must write exactly that child.
    body = body_of(minimal())
    converge(cluster, body, Events(), now=NOW)
    body = with_status(body, cluster)
    cluster.objects[("Service", "default", "m")]["spec"]["ports"][0]["appProtocol"] = "grpc"
    cluster.calls.clear()
    out = converge(cluster, body, Events(), now=NOW)
    assert out.applied == ["Service"] and cluster.writes() == [("apply", "Service")]
    assert cluster.objects[("Service", "default", "m")]["spec"]["ports"][0]["appProtocol"] == "http"


def test_a_hand_edited_list_entry_is_replaced_not_reported_as_invalid(cluster):
    # A port edited by hand is another manager's entry: the apply keeps it next to ours and
    # the API server refuses two ports named "http". The lists are replaced, then applied.
    body = body_of(minimal())
    converge(cluster, body, Events(), now=NOW)
    body = with_status(body, cluster)
    cluster.edit_service_port("default", "m", 9999)
    cluster.calls.clear()
    events = Events()
    out = converge(cluster, body, events, now=NOW)
    assert out.applied == ["Service"]
    assert cluster.writes() == [("apply", "Service"), ("replace_lists", "Service"),
                                ("apply", "Service")]  # fmt: skip
    assert [p["port"] for p in cluster.objects[("Service", "default", "m")]["spec"]["ports"]] == [
        8000
    ]
    assert [e[1] for e in events] == ["ChildRepaired", "Reconciled"]
    assert not [c for c in cluster.statuses[-1].get("conditions", []) if c["status"] == "False"
                and c["type"] == "SpecValid"]  # fmt: skip
    cluster.calls.clear()
    assert not converge(cluster, with_status(body, cluster), Events(), now=NOW).applied


def test_a_child_the_api_server_refuses_after_the_repair_is_an_invalid_spec(cluster, monkeypatch):
    # Negative control: what the repair cannot fix (the spec itself) is still reported.
    body = body_of(minimal())
    converge(cluster, body, Events(), now=NOW)
    apply = cluster.apply

    def refuse_deployments(manifest):
        if manifest["kind"] == "Deployment":
            cluster.calls.append(("apply", "Deployment"))
            exc = ApiException(status=422, reason="Unprocessable Entity")
            exc.body = '{"message": "spec.template.spec.affinity: bad"}'
            raise exc
        return apply(manifest)

    monkeypatch.setattr(cluster, "apply", refuse_deployments)
    cluster.objects[("Deployment", "default", "m")]["spec"]["paused"] = True  # drifted
    cluster.objects[("Deployment", "default", "m")]["metadata"]["annotations"].clear()
    cluster.calls.clear()
    with pytest.raises(SpecError, match="rejected the Deployment: spec.template.spec.affinity"):
        converge(cluster, with_status(body, cluster), Events(), now=NOW)
    assert ("replace_lists", "Deployment") in cluster.writes()
    cond = {c["type"]: c for c in cluster.statuses[-1]["conditions"]}["SpecValid"]
    assert cond["status"] == "False"


def test_deleted_child_is_recreated(cluster):
    body = body_of(minimal())
    converge(cluster, body, Events(), now=NOW)
    del cluster.objects[("Deployment", "default", "m")]
    out = converge(cluster, with_status(body, cluster), Events(), now=NOW)
    assert out.applied == ["Deployment"]


def test_server_defaults_and_hpa_replicas_do_not_cause_applies(cluster):
    body = body_of(
        minimal(
            autoscaling={"minReplicas": 1, "maxReplicas": 3}, resources={"requests": {"cpu": "0.5"}}
        )
    )
    converge(cluster, body, Events(), now=NOW)
    dep = cluster.objects[("Deployment", "default", "m")]
    dep["spec"]["replicas"] = 3  # the HPA scaled it
    dep["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"] = (
        "500m"  # normalized
    )
    cluster.calls.clear()
    out = converge(cluster, with_status(body, cluster), Events(), now=NOW)
    assert out.applied == []


def test_update_reapplies_changed_children_and_removes_optional_ones(cluster):
    body = body_of(ROOT / "samples/llama-70b-tp4.yaml")
    converge(cluster, body, Events(), now=NOW)
    body = with_status(body, cluster)
    body["metadata"]["generation"] = 2
    body["spec"]["autoscaling"] = None
    body["spec"]["replicas"] = 1
    body["spec"]["ingress"]["enabled"] = False
    cluster.calls.clear()
    events = Events()
    out = converge(cluster, body, events, now=NOW)
    assert out.applied == ["Deployment"]
    assert out.deleted == ["Ingress", "HorizontalPodAutoscaler", "PodDisruptionBudget"]
    assert cluster.objects[("Deployment", "models", "llama-70b")]["spec"]["replicas"] == 1
    assert events[0][1] == "Reconciled" and "deleted Ingress" in events[0][2]
    assert cluster.statuses[-1]["observedGeneration"] == 2


def test_optional_child_not_owned_is_left_alone(cluster):
    body = body_of(minimal())
    cluster.objects[("Ingress", "default", "m")] = {
        "metadata": {"name": "m", "ownerReferences": []}
    }
    out = converge(cluster, body, Events(), now=NOW)
    assert "Ingress" not in out.deleted and ("Ingress", "default", "m") in cluster.objects


def test_invalid_spec_sets_condition_posts_one_event_and_raises(cluster):
    body = body_of(ROOT / "samples/invalid/tp-not-dividing-gpus.yaml")
    events = Events()
    with pytest.raises(SpecError):
        converge(cluster, body, events, now=NOW)
    (status,) = cluster.status_patches
    assert status["phase"] == "Failed"
    cond = {c["type"]: c for c in status["conditions"]}["SpecValid"]
    assert cond["status"] == "False" and cond["reason"] == "InvalidSpec"
    assert "resources.gpus" in cond["message"] and "set gpus: 3" in cond["message"]
    assert [(t, r) for t, r, _ in events] == [("Warning", "InvalidSpec")]
    assert cluster.objects == {}  # nothing applied
    # Resync of the same invalid object: no status write, no second Event (no storm).
    body = with_status(body, cluster)
    cluster.calls.clear()
    with pytest.raises(SpecError):
        converge(cluster, body, events, now="2026-11-30T07:00:00Z")
    assert cluster.writes() == [] and len(events) == 1


def _kwargs(cluster, body, retry=0):
    cluster.store(body)
    meta = body["metadata"]
    return dict(
        body=body,
        namespace=meta["namespace"],
        name=meta["name"],
        memo=cluster.memo,
        retry=retry,
        logger=LOG,
    )


def test_handler_invalid_spec_is_permanent(cluster, monkeypatch):
    posted = []
    monkeypatch.setattr(kopf, "event", lambda body, **kw: posted.append(kw))
    body = body_of(ROOT / "samples/invalid/gpu-memory-utilization.yaml")
    with pytest.raises(kopf.PermanentError, match="gpuMemoryUtilization"):
        handlers.reconcile(**_kwargs(cluster, body))
    assert posted and posted[0]["reason"] == "InvalidSpec"


@pytest.mark.parametrize(
    "exc,kind,delay",
    [
        (ApiException(status=500, reason="Internal"), kopf.TemporaryError, 5),
        (ApiException(status=409, reason="Conflict"), kopf.TemporaryError, 5),
        (ApiException(status=403, reason="Forbidden"), kopf.TemporaryError, 5),
        (ConnectionRefusedError("refused"), kopf.TemporaryError, 5),
        (ApiException(status=422, reason="Unprocessable"), kopf.PermanentError, None),
    ],
)
def test_handler_classifies_api_errors(cluster, monkeypatch, exc, kind, delay):
    monkeypatch.setattr(kopf, "event", lambda body, **kw: None)
    cluster.fail_with = exc
    with pytest.raises(kind) as info:
        handlers.reconcile(**_kwargs(cluster, body_of(minimal())))
    if delay is not None:
        assert info.value.delay == delay


def test_backoff_grows_and_is_capped():
    assert [passes.backoff(r) for r in range(8)] == [5, 10, 20, 40, 80, 160, 300, 300]


def test_handler_converges_on_create_then_update(cluster, monkeypatch):
    monkeypatch.setattr(kopf, "event", lambda body, **kw: None)
    body = body_of(minimal())
    handlers.reconcile(**_kwargs(cluster, body))
    assert ("Deployment", "default", "m") in cluster.objects
    body = with_status(body, cluster)
    body["spec"]["streaming"] = {"protocols": ["sse"]}
    body["metadata"]["generation"] = 2
    cluster.calls.clear()
    handlers.reconcile(**_kwargs(cluster, body))
    assert cluster.writes().count(("apply", "Deployment")) == 1
    args = cluster.objects[("Deployment", "default", "m")]["spec"]["template"]["spec"][
        "containers"
    ][0]["args"]
    assert args[args.index("--protocols") + 1] == "sse"


def test_child_event_restores_and_updates_status(cluster, monkeypatch):
    monkeypatch.setattr(kopf, "event", lambda body, **kw: None)
    body = body_of(minimal(replicas=2))
    converge(cluster, body, Events(), now=NOW)
    parent = with_status(body, cluster)
    cluster.objects[("StreamingModel", "default", "m")] = parent
    # The Deployment became ready and someone removed the Service.
    cluster.set_deployment_status(
        "default", "m", replicas=2, readyReplicas=2, updatedReplicas=2, availableReplicas=2
    )
    del cluster.objects[("Service", "default", "m")]
    child = cluster.objects[("Deployment", "default", "m")]
    handlers._owner_changed(child, "default", cluster.memo, LOG, "MODIFIED")
    assert ("Service", "default", "m") in cluster.objects
    assert cluster.statuses[-1]["phase"] == "Ready"


def test_child_event_for_deleted_parent_does_nothing(cluster):
    child = {"metadata": {"name": "gone", "labels": {"app.kubernetes.io/instance": "gone"}}}
    handlers._owner_changed(child, "default", cluster.memo, LOG, "DELETED")
    assert cluster.writes() == []


def test_handlers_registered_for_create_update_resume_and_children():
    registry = kopf._core.intents.registries.get_default_registry()
    ids = {h.id for h in registry._changing.get_all_handlers()}
    assert "reconcile" in ids
    watched = {h.id for h in registry._watching.get_all_handlers()}
    assert {"child-deployments", "child-services", "child-ingresses", "child-pods"} <= watched


@pytest.mark.parametrize(
    "want,have,ok",
    [
        ({"a": 1}, {"a": 1, "b": 2}, True),
        ({"a": [1, 2]}, {"a": [1]}, False),
        ({"cpu": "0.5"}, {"cpu": "500m"}, True),
        ({"mem": "1024Mi"}, {"mem": "1Gi"}, True),
        ({"port": 8000}, {"port": "8000"}, True),
        ({"x": True}, {"x": 1}, False),
        ({"a": {"b": "c"}}, {"a": {"b": "d"}}, False),
        ({"a": "x"}, {}, False),
    ],
)
def test_contains(want, have, ok):
    assert contains(want, have) is ok


def test_api_server_rejecting_a_child_is_reported_as_invalid_spec(cluster, monkeypatch):
    posted = []
    monkeypatch.setattr(kopf, "event", lambda body, **kw: posted.append(kw))
    exc = ApiException(status=422, reason="Unprocessable Entity")
    exc.body = '{"kind":"Status","message":"Deployment.apps \\"m\\" is invalid: spec.template.spec.affinity: bad"}'
    cluster.fail_with = exc
    body = body_of(minimal(resources={"affinity": {"nodeAffinity": {"bogus": 1}}}))
    with pytest.raises(kopf.PermanentError, match="rejected the Service"):
        handlers.reconcile(**_kwargs(cluster, body))
    cond = {c["type"]: c for c in cluster.statuses[-1]["conditions"]}["SpecValid"]
    assert cond["status"] == "False" and "spec.template.spec.affinity: bad" in cond["message"]
    assert [p["reason"] for p in posted] == ["InvalidSpec"]


def test_handler_reads_the_object_fresh_so_a_stale_event_body_writes_nothing(cluster, monkeypatch):
    # The create handler and the first child events race; a handler holding the body from
    # before the last status patch must not write the same status again.
    monkeypatch.setattr(kopf, "event", lambda body, **kw: None)
    body = body_of(minimal())
    handlers.reconcile(**_kwargs(cluster, body))
    stale = body  # no status: what an early watch event carried
    cluster.calls.clear()
    handlers.reconcile(
        body=stale,
        namespace="default",
        name="m",
        memo=cluster.memo,
        retry=0,
        logger=LOG,
    )
    child = cluster.objects[("Deployment", "default", "m")]
    handlers._owner_changed(child, "default", cluster.memo, LOG, "MODIFIED")
    assert cluster.writes() == []


def test_converge_logs_at_info_without_breaking(cluster, caplog):
    # Regression: a log `extra` named "name" made every applying pass raise after the apply.
    caplog.set_level(logging.DEBUG)
    out = converge(cluster, body_of(minimal()), Events(), now=NOW)
    assert out.applied
    assert any("applied Service, Deployment" in r.getMessage() for r in caplog.records)


def test_terminating_namespace_is_not_an_error(cluster, monkeypatch):
    monkeypatch.setattr(kopf, "event", lambda body, **kw: None)
    exc = ApiException(status=403, reason="Forbidden")
    exc.body = '{"message":"services \\"m\\" is forbidden: unable to create new content in namespace x because it is being terminated"}'
    cluster.fail_with = exc
    handlers.reconcile(**_kwargs(cluster, body_of(minimal())))  # returns quietly


def test_turning_autoscaling_off_removes_its_status(cluster):
    body = body_of(minimal(autoscaling={"maxReplicas": 3}))
    converge(cluster, body, Events(), now=NOW)
    body = with_status(body, cluster)
    assert body["status"]["autoscaling"]["metric"] == "sluice_ttft_p90_seconds"
    body["spec"]["autoscaling"] = None
    converge(cluster, body, Events(), now=NOW)
    assert cluster.status_patches[-1]["autoscaling"] is None  # merge patch: null removes it
    assert "autoscaling" not in cluster.statuses[-1]


# RFC 7386's own examples (appendix A): the fake applies status patches exactly like this.
@pytest.mark.parametrize(
    "target, patch, result",
    [
        ({"a": "b"}, {"a": "c"}, {"a": "c"}),
        ({"a": "b"}, {"b": "c"}, {"a": "b", "b": "c"}),
        ({"a": "b"}, {"a": None}, {}),
        ({"a": "b", "b": "c"}, {"a": None}, {"b": "c"}),
        ({"a": ["b"]}, {"a": "c"}, {"a": "c"}),
        ({"a": "c"}, {"a": ["b"]}, {"a": ["b"]}),
        ({"a": {"b": "c"}}, {"a": {"b": "d", "c": None}}, {"a": {"b": "d"}}),
        ({"a": [{"b": "c"}]}, {"a": [1]}, {"a": [1]}),
        ({"e": None}, {"a": 1}, {"e": None, "a": 1}),
        ({}, {"a": {"bb": {"ccc": None}}}, {"a": {"bb": {}}}),
    ],
)
def test_fake_applies_rfc7386_merge_patches(target, patch, result):
    assert merge_patch(target, patch) == result


def _hpa_with_message(cluster, message):
    cluster.objects[("HorizontalPodAutoscaler", "default", "m")]["status"] = {
        "currentReplicas": 1,
        "conditions": [{"type": "ScalingActive", "status": "False", "message": message}]
        if message
        else [{"type": "ScalingActive", "status": "True", "reason": "ValidMetricFound"}],
    }


def test_vanished_status_keys_are_removed_and_status_settles(cluster):
    """The HPA's 'no metrics' message and a dropped endpoint leave status, and the pass after
    that writes nothing: the status the operator wants is the status stored."""
    body = body_of(
        minimal(autoscaling={"maxReplicas": 3}, streaming={"protocols": ["sse", "websocket"]})
    )
    converge(cluster, body, Events(), now=NOW)
    _hpa_with_message(cluster, "unable to get metric: no metrics returned")
    converge(cluster, with_status(body, cluster), Events(), now=NOW)
    body = with_status(body, cluster)
    assert body["status"]["autoscaling"]["message"].startswith("unable to get metric")
    assert set(body["status"]["endpoints"]) == {"openai", "sse", "websocket"}

    _hpa_with_message(cluster, None)
    body["spec"]["streaming"] = {"protocols": ["sse"]}
    converge(cluster, body, Events(), now=NOW)
    assert cluster.status_patches[-1]["autoscaling"]["message"] is None
    assert cluster.status_patches[-1]["endpoints"] == {"websocket": None}
    body = with_status(body, cluster)
    assert "message" not in body["status"]["autoscaling"]
    assert set(body["status"]["endpoints"]) == {"openai", "sse"}
    cluster.calls.clear()
    out = converge(cluster, body, Events(), now=NOW)
    assert not out.status_written and cluster.writes() == []


def test_whole_status_as_merge_patch_never_forgets(cluster):
    """Negative control: the fake has the API server's merge semantics, so the old write (the
    whole new status as a merge patch) keeps the vanished key and differs on every pass."""
    cluster.stored_status[("default", "m")] = {
        "autoscaling": {"backend": "hpa", "message": "unable"}
    }
    cluster.patch_status("default", "m", {"autoscaling": {"backend": "hpa"}})
    assert cluster.stored_status[("default", "m")]["autoscaling"]["message"] == "unable"


def test_surge_rollout_reads_pods_and_reports_the_unschedulable_surge_pod(cluster):
    """All wanted replicas ready but a rollout under way: the pods are read, so a surge pod
    that found no GPU is named in status with the scheduler's reason."""
    body = body_of(minimal())
    converge(cluster, body, Events(), now=NOW)
    cluster.set_deployment_status(
        "default", "m", replicas=2, readyReplicas=1, updatedReplicas=0, availableReplicas=1
    )
    cluster.pods = [
        {
            "metadata": {"name": "m-new"},
            "status": {
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": "0/1 nodes are available: 1 Insufficient nvidia.com/gpu.",
                    }
                ]
            },
        }
    ]
    cluster.calls.clear()
    converge(cluster, with_status(body, cluster), Events(), now=NOW)
    assert ("list", "Pod") in cluster.calls
    status = cluster.statuses[-1]
    assert status["phase"] == "Progressing" and "Insufficient nvidia.com/gpu" in status["message"]
    # Settled (rollout done): no pod reads at all.
    cluster.set_deployment_status(
        "default", "m", replicas=1, readyReplicas=1, updatedReplicas=1, availableReplicas=1
    )
    converge(cluster, with_status(body, cluster), Events(), now=NOW)
    cluster.calls.clear()
    converge(cluster, with_status(body, cluster), Events(), now=NOW)
    assert ("list", "Pod") not in cluster.calls and cluster.writes() == []


def _slow_passes(monkeypatch):
    """Count converge passes; the first one blocks until released."""
    import threading

    started, release = threading.Event(), threading.Event()
    ran = []
    real = passes.converge

    def slow(cluster, body, post, **kw):
        ran.append(body["metadata"]["name"])
        started.set()
        release.wait(60)  # a bound for a failing test; the test releases it
        return real(cluster, body, post, **kw)

    monkeypatch.setattr(passes, "converge", slow)
    return started, release, ran


def test_model_locks_collapse_bursts_and_forget_finished_models(cluster, monkeypatch):
    """N child events while a pass runs cost one more pass, not N, and return at once (no
    worker thread waits); the model's own handlers never skip; the lock table empties."""
    import threading

    monkeypatch.setattr(kopf, "event", lambda body, **kw: None)
    body = body_of(minimal())
    cluster.store(body)
    converge(cluster, body, Events(), now=NOW)
    started, release, ran = _slow_passes(monkeypatch)
    child = cluster.objects[("Deployment", "default", "m")]

    def event():
        handlers._owner_changed(child, "default", cluster.memo, LOG, "MODIFIED")

    first = threading.Thread(target=event)
    first.start()
    assert started.wait(5)
    burst = threading.Thread(target=lambda: [event() for _ in range(20)])
    burst.start()
    burst.join(30)
    # Each returned while the first pass still runs (it waits for `release`): none waited
    # for it, the running pass was marked dirty instead.
    assert not burst.is_alive() and first.is_alive()
    assert len(cluster.runtime.passes.locks) == 1
    release.set()
    first.join(5)
    assert len(ran) == 2  # the running pass and one more for the whole burst
    assert len(cluster.runtime.passes.locks) == 0
    # Negative control: the model's own handler is never collapsed.
    ran.clear()
    handlers.reconcile(**_kwargs(cluster, body))
    handlers.reconcile(**_kwargs(cluster, body))
    assert len(ran) == 2 and len(cluster.runtime.passes.locks) == 0


def test_lock_table_stays_bounded_over_many_models_and_deletions(cluster, monkeypatch):
    monkeypatch.setattr(kopf, "event", lambda body, **kw: None)
    for i in range(30):
        body = body_of({**minimal(), "metadata": {"name": f"m{i}", "namespace": "default"}})
        handlers.reconcile(**_kwargs(cluster, body))
        child = cluster.objects[("Deployment", "default", f"m{i}")]
        del cluster.objects[("StreamingModel", "default", f"m{i}")]  # the model is deleted
        handlers._owner_changed(child, "default", cluster.memo, LOG, "DELETED")
        assert len(cluster.runtime.passes.locks) == 0
    cluster.memory.prune()  # what the resync does: own writes of gone models are dropped
    assert len(cluster.memory) == 0


def _resync(cluster):
    resync = cluster.runtime.resync
    before = resync.passes
    resync.adopt_context()  # what the first kopf handler call does
    resync.run_once()
    assert resync.passes - before == len(cluster.memory.models())


def test_index_fed_passes_make_no_reads_and_a_settled_pass_no_call(cluster, monkeypatch):
    monkeypatch.setattr(kopf, "event", lambda body, **kw: None)
    body = body_of(minimal(replicas=2))
    handlers.reconcile(**_kwargs(cluster, body))
    # Applied and status written; one GET: the model is still there before creating.
    assert cluster.reads() == [("get", "StreamingModel")] and cluster.writes()
    cluster.calls.clear()
    cluster.set_deployment_status(
        "default", "m", replicas=2, readyReplicas=2, updatedReplicas=2, availableReplicas=2
    )
    child = cluster.objects[("Deployment", "default", "m")]
    handlers._owner_changed(child, "default", cluster.memo, LOG, "MODIFIED")
    assert cluster.reads() == [] and cluster.statuses[-1]["phase"] == "Ready"
    cluster.calls.clear()
    for _ in range(3):  # settled: child events and resyncs make no call at all
        handlers._owner_changed(child, "default", cluster.memo, LOG, "MODIFIED")
    _resync(cluster)
    assert cluster.calls == []
    # Negative control: the same pass reading through the API costs one GET per child kind.
    converge(cluster, with_status(body, cluster), Events(), now=NOW)
    assert len(cluster.reads()) >= 6 and cluster.writes() == []


def test_resync_restores_a_hand_edit_it_was_not_told_about(cluster, monkeypatch):
    monkeypatch.setattr(kopf, "event", lambda body, **kw: None)
    body = body_of(minimal())
    handlers.reconcile(**_kwargs(cluster, body))
    cluster.objects[("Service", "default", "m")]["spec"]["ports"][0]["appProtocol"] = "grpc"
    cluster.calls.clear()
    _resync(cluster)
    assert cluster.writes() == [("apply", "Service")] and cluster.reads() == []


def _again(cluster, body):
    """The model's handler once more, the model as stored (kopf's update/resume)."""
    meta = body["metadata"]
    handlers.reconcile(body=body, namespace=meta["namespace"], name=meta["name"],
                       memo=cluster.memo, retry=0, logger=LOG)  # fmt: skip


def test_a_lagging_watch_neither_recreates_nor_redeletes(cluster, monkeypatch):
    """Right after a write the index does not show it yet: the pass after believes the
    write's result, so nothing is applied, deleted or status-patched twice."""
    monkeypatch.setattr(kopf, "event", lambda body, **kw: None)
    body = body_of(ROOT / "samples/llama-70b-tp4.yaml")
    cluster.store(body)
    cluster.watched.lag()  # the watch shows the model, and none of what the passes write
    handlers.reconcile(**_kwargs(cluster, body))
    first = list(cluster.writes())
    assert ("apply", "Deployment") in first and ("patch_status", "StreamingModel") in first
    cluster.calls.clear()
    _again(cluster, body)
    assert cluster.calls == []
    # The spec drops the Ingress: deleted once, though the lagging index still has it.
    changed = with_status(body, cluster)
    changed["spec"]["ingress"]["enabled"] = False
    cluster.store(changed)
    cluster.watched.catch_up()
    cluster.watched.lag()
    cluster.calls.clear()
    handlers.reconcile(**_kwargs(cluster, changed))
    assert ("delete", "Ingress") in cluster.writes()
    cluster.calls.clear()
    _again(cluster, changed)
    assert cluster.calls == []
    # Caught up: the remembered writes are dropped as the index shows them.
    cluster.watched.catch_up()
    cluster.memory.forget("Ingress", "models", "llama-70b")  # the DELETED event
    _again(cluster, changed)
    _again(cluster, changed)  # reads what the one before wrote
    assert len(cluster.memory) == 0


def test_lagging_watch_without_remembered_writes_would_write_twice(cluster, monkeypatch):
    """Negative control for the test above: a memory that forgets its own writes applies
    every child again while the watch lags."""
    from sluice_operator.cluster_view import ClusterView

    monkeypatch.setattr(kopf, "event", lambda body, **kw: None)
    body = body_of(minimal())
    cluster.store(body)
    cluster.watched.lag()
    handlers.reconcile(**_kwargs(cluster, body))
    cluster.runtime = runtime_for(cluster, memory=ClusterView(cluster.watched))
    cluster.calls.clear()
    _again(cluster, body)
    assert ("apply", "Deployment") in cluster.writes()


def test_deleted_child_event_recreates_it_from_memory(cluster, monkeypatch):
    monkeypatch.setattr(kopf, "event", lambda body, **kw: None)
    body = body_of(minimal())
    handlers.reconcile(**_kwargs(cluster, body))
    gone = cluster.objects.pop(("Service", "default", "m"))
    cluster.calls.clear()
    handlers._owner_changed(gone, "default", cluster.memo, LOG, "DELETED")
    assert cluster.writes() == [("apply", "Service")]
    assert cluster.reads() == [("get", "StreamingModel")]  # still there: create


@pytest.mark.parametrize("model_deleted", [True, False])
def test_children_of_a_model_memory_still_holds_are_not_recreated(
    cluster, monkeypatch, model_deleted
):
    """The garbage collector removes the children of a deleted model while memory may still
    hold the model (its DELETED event not yet processed): a pass asks the API server before
    creating anything. Negative control: a model that is still there gets its child back."""
    monkeypatch.setattr(kopf, "event", lambda body, **kw: None)
    body = body_of(minimal())
    handlers.reconcile(**_kwargs(cluster, body))
    gone = cluster.objects.pop(("Deployment", "default", "m"))  # the garbage collector
    cluster.watched.lag()  # the watch shows that, not yet the model's deletion
    if model_deleted:
        del cluster.objects[("StreamingModel", "default", "m")]
    cluster.calls.clear()
    handlers._owner_changed(gone, "default", cluster.memo, LOG, "DELETED")
    assert cluster.reads() == [("get", "StreamingModel")]
    assert cluster.writes() == ([] if model_deleted else [("apply", "Deployment")])


def test_memory_prefers_the_newer_of_the_watch_and_its_own_write():
    from sluice_operator.cluster_view import ClusterView
    from sluice_operator.kinds import SERVICE

    def svc(rv, port):
        labels = {"app.kubernetes.io/instance": "m"}
        meta = {"name": "m", "namespace": "ns", "resourceVersion": str(rv), "labels": labels}
        return {"kind": "Service", "metadata": meta, "spec": {"port": port}}

    index: dict = {}
    memory = ClusterView({SERVICE.index_id: index})
    memory.wrote(svc(10, 1))
    assert memory.get(SERVICE, "ns", "m")["spec"]["port"] == 1  # the watch has nothing yet
    index[("ns", "m")] = [svc(9, 0)]  # the watch shows the state before our write
    assert memory.get(SERVICE, "ns", "m")["spec"]["port"] == 1 and len(memory) == 1
    index[("ns", "m")] = [svc(12, 2)]  # a later change by someone else
    assert memory.get(SERVICE, "ns", "m")["spec"]["port"] == 2 and len(memory) == 0
    memory.deleted(SERVICE, "ns", "m", svc(12, 2))
    assert memory.get(SERVICE, "ns", "m") is None and len(memory) == 1  # the watch lags
    index[("ns", "m")] = [svc(15, 3)]  # made again after our delete
    assert memory.get(SERVICE, "ns", "m")["spec"]["port"] == 3 and len(memory) == 0


def test_resync_thread_survives_a_failing_pass(cluster, monkeypatch):
    monkeypatch.setattr(kopf, "event", lambda body, **kw: None)
    cluster.runtime = runtime_for(cluster, resync_seconds=0.01)
    handlers.reconcile(**_kwargs(cluster, body_of(minimal())))
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("a bug")

    monkeypatch.setattr(passes, "converge", broken)
    resync = cluster.runtime.resync
    resync.adopt_context()
    resync.start()
    try:  # every round tried again after the failure
        eventually(lambda: len(calls) >= 3, timeout=5, interval=0.01, message="3 resync rounds")
    finally:
        resync.stop()
    assert len(cluster.runtime.passes.locks) == 0


def test_memory_keeps_objects_without_managed_fields():
    from sluice_operator.cluster_view import ClusterView, lean
    from sluice_operator.kinds import SERVICE

    obj = {
        "kind": "Service",
        "metadata": {"name": "m", "namespace": "ns", "resourceVersion": "3",
                     "managedFields": [{"manager": "sluice-operator"}]},
    }  # fmt: skip
    assert "managedFields" not in lean(obj)["metadata"] and "managedFields" in obj["metadata"]
    memory = ClusterView({SERVICE.index_id: {}})
    memory.wrote(obj)
    assert "managedFields" not in memory.get(SERVICE, "ns", "m")["metadata"]
