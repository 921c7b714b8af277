"""Rollout pacing (`pacing.py`): an operator release that changes pod templates rolls at most
N models at a time, each until its new pods are Ready; a model whose own spec changed is
never held back; waiting models say so in status and in one Event."""

from __future__ import annotations

import copy

import pytest
from operator_helpers import Events, FakeCluster, body_of, minimal, with_status
from sluice_operator import reconcile
from sluice_operator.kinds import DEPLOYMENT
from sluice_operator.pacing import (
    PACED,
    TEMPLATE_HASH,
    RolloutPacer,
    cause_of_change,
    rolling,
    stamp,
    template_hash,
)
from sluice_operator.reconcile import converge

NOW = "2026-11-30T06:00:00Z"


def _deployment(template: dict, paced: bool = False, **status):
    dep = stamp(
        {
            "metadata": {"name": "m", "namespace": "ns"},
            "spec": {"replicas": 1, "template": template},
        },
        paced,
    )
    dep["metadata"]["generation"] = 2
    dep["status"] = {"observedGeneration": 2, "replicas": 1, "updatedReplicas": 1,
                     "readyReplicas": 1, **status}  # fmt: skip
    return dep


OLD = {"metadata": {"labels": {"a": "1"}}, "spec": {"containers": [{"name": "s", "image": "x:1"}]}}
NEW = copy.deepcopy(OLD) | {"metadata": {"labels": {"a": "1"}, "annotations": {"new": "probe"}}}


@pytest.mark.parametrize(
    "live,generation,observed,contained,cause",
    [
        (None, 1, None, False, "none"),  # a new model: nothing restarts
        (_deployment(NEW), 1, 1, True, "none"),  # the template is the one rendered
        (_deployment(OLD), 2, 1, False, "spec"),  # the model changed since
        (_deployment(OLD), 1, 1, False, "operator"),  # nobody changed it: the release did
        # Written by a release without the labels: judged by the template and status.
        ({"metadata": {}, "spec": {"template": OLD}}, 1, 1, True, "none"),
        ({"metadata": {}, "spec": {"template": OLD}}, 3, 3, False, "operator"),
        ({"metadata": {}, "spec": {"template": OLD}}, 4, 3, False, "spec"),
        ({"metadata": {}, "spec": {"template": OLD}}, 4, None, False, "spec"),
    ],
)
def test_who_changes_the_template(live, generation, observed, contained, cause):
    desired = {"metadata": {}, "spec": {"template": NEW}}
    assert cause_of_change(desired, live, generation, observed, contained) == cause


def test_stamp_records_the_template_it_applied():
    dep = _deployment(NEW, paced=True)
    labels = dep["metadata"]["labels"]
    assert labels[TEMPLATE_HASH] == template_hash(dep) == labels[PACED]
    assert PACED not in _deployment(NEW)["metadata"]["labels"]
    # Nothing of pacing in the pod template, and no annotation (those move a generation).
    assert TEMPLATE_HASH not in dep["spec"]["template"]["metadata"]["labels"]
    assert "annotations" not in dep["metadata"]


def test_a_paced_rollout_is_under_way_until_the_new_pods_are_ready():
    assert rolling(_deployment(NEW, paced=True, readyReplicas=0))
    assert rolling(_deployment(NEW, paced=True, updatedReplicas=0))
    assert not rolling(_deployment(NEW, paced=True))  # settled
    assert not rolling(_deployment(NEW, paced=False, readyReplicas=0))  # not paced


class Fleet:
    """Deployments as memory would show them, for a pacer."""

    def __init__(self) -> None:
        self.deployments: dict[tuple[str, str], dict] = {}
        self.woken: list[list[tuple[str, str]]] = []

    def pacer(self, limit: int) -> RolloutPacer:
        return RolloutPacer(limit, lambda: list(self.deployments.items()), self.woken.append)


def test_at_most_limit_admitted_in_arrival_order_and_a_freed_slot_wakes_the_next():
    fleet = Fleet()
    keys = [("ns", f"m{i}") for i in range(5)]
    for key in keys:
        fleet.deployments[key] = _deployment(OLD)
    pacer = fleet.pacer(2)
    old = template_hash(_deployment(OLD))
    decisions = {key: pacer.admit(key, "new", old) for key in keys}
    assert [decisions[k].admitted for k in keys] == [True, True, False, False, False]
    assert [decisions[k].ahead for k in keys[2:]] == [0, 1, 2]
    assert pacer.waiting == keys[2:]
    # m0 and m1 roll (their writes are in memory), m2 asks again: still no slot.
    for key in keys[:2]:
        fleet.deployments[key] = _deployment(NEW, paced=True, readyReplicas=0)
        fleet.deployments[key]["metadata"]["labels"][TEMPLATE_HASH] = "new"
        fleet.deployments[key]["metadata"]["labels"][PACED] = "new"
    assert not pacer.admit(keys[2], "new", old).admitted
    pacer.observe(keys[0], fleet.deployments[keys[0]])
    assert fleet.woken == []  # still rolling
    fleet.deployments[keys[0]]["status"]["readyReplicas"] = 1  # its new pod is Ready
    pacer.observe(keys[0], fleet.deployments[keys[0]])
    assert fleet.woken == [[keys[2]]]
    assert not pacer.admit(keys[3], "new", old).admitted  # m2 is first in line
    assert pacer.admit(keys[2], "new", old).admitted
    assert pacer.waiting == keys[3:]


def test_a_new_leader_counts_the_rollouts_its_predecessor_started():
    fleet = Fleet()
    for i in range(2):
        dep = _deployment(NEW, paced=True, readyReplicas=0)
        fleet.deployments[("ns", f"rolling{i}")] = dep
    fleet.deployments[("ns", "next")] = _deployment(OLD)
    pacer = fleet.pacer(2)  # fresh process: no claims of its own
    assert not pacer.admit(("ns", "next"), template_hash(_deployment(NEW)), "old").admitted


def test_no_limit_admits_everything():
    fleet = Fleet()
    pacer = fleet.pacer(0)
    assert all(pacer.admit(("ns", f"m{i}"), "new", "old").admitted for i in range(20))


# ---- through reconcile.converge --------------------------------------------------------


def _new_release(monkeypatch):
    """What a release that adds a pod annotation to every model renders."""
    real = reconcile.desired_children

    def newer(model):
        out = real(model)
        meta = out["Deployment"]["spec"]["template"]["metadata"]
        meta["annotations"]["example.com/new-release"] = "true"
        return out

    monkeypatch.setattr(reconcile, "desired_children", newer)


def _fleet(cluster, n):
    bodies = []
    for i in range(n):
        body = body_of(minimal() | {"metadata": {"name": f"m{i}", "namespace": "default"}})
        converge(cluster, body, Events(), now=NOW)
        cluster.set_deployment_status("default", f"m{i}", replicas=1, readyReplicas=1,
                                      updatedReplicas=1, availableReplicas=1)  # fmt: skip
        bodies.append(with_status(body, cluster))
    return bodies


def _template(cluster, name):
    return cluster.objects[("Deployment", "default", name)]["spec"]["template"]


def _memory_pacer(cluster, limit, woken):
    def deployments():
        return [
            (("default", name), copy.deepcopy(obj))
            for (kind, _, name), obj in cluster.objects.items()
            if kind == DEPLOYMENT.kind
        ]

    return RolloutPacer(limit, deployments, woken.append)


def test_an_upgrade_that_changes_no_template_rolls_nothing(monkeypatch):
    """Deployments written before pacing (no labels) get them, the same applied-hash
    annotation (annotations move a Deployment's generation) and no new template."""
    cluster = FakeCluster()
    bodies = _fleet(cluster, 3)
    before = {b["metadata"]["name"]: copy.deepcopy(_template(cluster, b["metadata"]["name"]))
              for b in bodies}  # fmt: skip
    for key, obj in cluster.objects.items():
        if key[0] == "Deployment":  # what an earlier release left
            for a in (TEMPLATE_HASH, PACED):
                obj["metadata"]["labels"].pop(a, None)
    hashes = {
        k: o["metadata"]["annotations"] for k, o in cluster.objects.items() if k[0] == "Deployment"
    }
    pacer = _memory_pacer(cluster, 1, [])
    for body in bodies:
        events = Events()
        converge(cluster, with_status(body, cluster), events, now=NOW, pacer=pacer)
        assert not [e for e in events if e[1] == "RolloutWaiting"]
    for name, template in before.items():
        assert _template(cluster, name) == template
        key = ("Deployment", "default", name)
        labels = cluster.objects[key]["metadata"]["labels"]
        assert labels[TEMPLATE_HASH] == template_hash(cluster.applied[key])  # as applied
    for key, kept in hashes.items():
        assert cluster.objects[key]["metadata"]["annotations"] == kept
    assert pacer.waiting == []


def test_a_release_that_changes_templates_rolls_two_at_a_time(monkeypatch):
    cluster = FakeCluster()
    bodies = _fleet(cluster, 5)
    _new_release(monkeypatch)
    woken: list = []
    pacer = _memory_pacer(cluster, 2, woken)
    events = {}
    for body in bodies:
        events[body["metadata"]["name"]] = Events()
        converge(cluster, with_status(body, cluster), events[body["metadata"]["name"]],
                 now=NOW, pacer=pacer)  # fmt: skip

    def new(name):
        return "example.com/new-release" in _template(cluster, name)["metadata"]["annotations"]

    assert [new(f"m{i}") for i in range(5)] == [True, True, False, False, False]
    for i in (2, 3, 4):
        status = cluster.stored_status[("default", f"m{i}")]
        (cond,) = [c for c in status["conditions"] if c["type"] == "TemplateCurrent"]
        assert cond["status"] == "False" and cond["reason"] == "WaitingForRolloutSlot"
        assert "rolling now: default/m0, default/m1" in cond["message"]
        assert status["phase"] == "Ready"  # the old pods keep serving
        assert [e[1] for e in events[f"m{i}"]] == ["RolloutWaiting"]
    # A second pass of a waiting model writes nothing new and posts no second Event.
    again = Events()
    cluster.calls.clear()
    converge(cluster, with_status(bodies[4], cluster), again, now=NOW, pacer=pacer)
    assert again == [] and cluster.writes() == []
    # m0's new pod is Ready: its pass frees the slot and wakes m2, which then rolls.
    cluster.set_deployment_status("default", "m0", replicas=1, readyReplicas=1,
                                  updatedReplicas=1, availableReplicas=1)  # fmt: skip
    converge(cluster, with_status(bodies[0], cluster), Events(), now=NOW, pacer=pacer)
    assert woken == [[("default", "m2")]]
    converge(cluster, with_status(bodies[2], cluster), Events(), now=NOW, pacer=pacer)
    assert new("m2") and not new("m3")
    status = cluster.stored_status[("default", "m2")]
    assert not [c for c in status["conditions"] if c["type"] == "TemplateCurrent"]


def test_a_model_with_no_ready_replica_rolls_at_once_and_holds_no_slot(monkeypatch):
    """m1 serves nothing (its pods cannot become Ready: a missing claim, no free GPU): it
    rolls at once without a slot, so it cannot stall the others' rollout; m0 takes the one
    slot and m2 waits for it, as without m1."""
    cluster = FakeCluster()
    bodies = _fleet(cluster, 3)
    cluster.set_deployment_status("default", "m1", replicas=1, readyReplicas=0,
                                  updatedReplicas=1, availableReplicas=0)  # fmt: skip
    _new_release(monkeypatch)
    woken: list = []
    pacer = _memory_pacer(cluster, 1, woken)
    for body in bodies:
        converge(cluster, with_status(body, cluster), Events(), now=NOW, pacer=pacer)

    def new(name):
        return "example.com/new-release" in _template(cluster, name)["metadata"]["annotations"]

    assert [new(f"m{i}") for i in range(3)] == [True, True, False]
    assert PACED not in cluster.objects[("Deployment", "default", "m1")]["metadata"]["labels"]
    assert pacer.waiting == [("default", "m2")]
    # m1 stays unready; m0's new pod is Ready: m2 is woken all the same.
    cluster.set_deployment_status("default", "m0", replicas=1, readyReplicas=1,
                                  updatedReplicas=1, availableReplicas=1)  # fmt: skip
    converge(cluster, with_status(bodies[0], cluster), Events(), now=NOW, pacer=pacer)
    assert woken == [[("default", "m2")]]


def test_a_model_whose_spec_changed_is_never_held_back(monkeypatch):
    cluster = FakeCluster()
    bodies = _fleet(cluster, 3)
    _new_release(monkeypatch)
    pacer = _memory_pacer(cluster, 1, [])
    for body in bodies:
        converge(cluster, with_status(body, cluster), Events(), now=NOW, pacer=pacer)
    assert pacer.waiting == [("default", "m1"), ("default", "m2")]
    edited = with_status(bodies[2], cluster)
    edited["spec"]["streaming"] = {"protocols": ["sse"]}
    edited["metadata"]["generation"] = 2
    converge(cluster, edited, Events(), now=NOW, pacer=pacer)
    template = _template(cluster, "m2")
    assert "example.com/new-release" in template["metadata"]["annotations"]
    args = template["spec"]["containers"][0]["args"]
    assert args[args.index("--protocols") + 1] == "sse"
    assert pacer.waiting == [("default", "m1")]
    dep = cluster.objects[("Deployment", "default", "m2")]
    assert PACED not in dep["metadata"]["labels"]  # took no slot


def test_without_a_pacer_a_release_applies_everywhere(monkeypatch):
    """Negative control: the same fleet, no pacer: every template changes in one round."""
    cluster = FakeCluster()
    bodies = _fleet(cluster, 4)
    _new_release(monkeypatch)
    for body in bodies:
        converge(cluster, with_status(body, cluster), Events(), now=NOW)
    assert all(
        "example.com/new-release" in _template(cluster, f"m{i}")["metadata"]["annotations"]
        for i in range(4)
    )


def test_the_operator_paces_with_its_flag_and_wakes_through_the_resync(monkeypatch):
    """kopf's startup (`handlers.configure`) wires the pacer from `run`'s options: its limit,
    the passes pace with it, and a freed slot converges through the resync at once."""
    import asyncio
    import logging

    import kopf
    from sluice_operator import handlers, wiring

    cluster = FakeCluster()
    real = wiring.wire
    monkeypatch.setattr(handlers, "wire", lambda *a: real(*a, cluster=cluster))  # no kubeconfig
    memo = kopf.Memo(options=wiring.Options(max_rollouts=3, resync_seconds=0))
    handlers.configure(settings=kopf.OperatorSettings(), memo=memo, logger=logging.getLogger("t"))
    runtime = wiring.runtime_of(memo)
    try:
        assert runtime.pacer.limit == 3 and runtime.passes.pacer is runtime.pacer
        assert runtime.pacer._wake == runtime.resync.converge_soon  # a freed slot converges at once
    finally:
        asyncio.run(runtime.stop())


# ---- LeaderWorkerSets (models on several nodes) ------------------------------------------

TWO_NODES = {"resources": {"gpus": 8}, "parallelism": {"tensor": 8, "pipeline": 2, "nodes": 2}}
LWS = "LeaderWorkerSet"


def _lws(paced: bool = False, template: dict | None = None, **status):
    lws = stamp(
        {
            "kind": LWS,
            "metadata": {"name": "m", "namespace": "ns"},
            "spec": {"replicas": 1, "leaderWorkerTemplate": {"size": 2, **(template or {})}},
        },
        paced,
    )
    lws["metadata"]["generation"] = 2
    lws["status"] = {"observedGeneration": 2, "replicas": 1, "updatedReplicas": 1,
                     "readyReplicas": 1, **status}  # fmt: skip
    return lws


def test_an_lws_template_is_its_leader_worker_template():
    """The hash covers what makes an LWS roll its groups (leader and worker templates, group
    size), and a Deployment's hash is the one earlier releases labelled (spec.template)."""
    a = _lws(template={"leaderTemplate": OLD, "workerTemplate": OLD})
    b = _lws(template={"leaderTemplate": OLD, "workerTemplate": NEW})
    assert template_hash(a) != template_hash(b)
    assert template_hash(a) == template_hash(
        {"spec": {"template": a["spec"]["leaderWorkerTemplate"]}}
    )
    assert rolling(_lws(paced=True, readyReplicas=0))
    assert rolling(_lws(paced=True, observedGeneration=1))  # the LWS controller has not seen it
    assert not rolling(_lws(paced=True))


def test_an_lws_rollout_holds_its_slot_though_memory_has_no_lws():
    """Memory holds Deployments only: the pacer keeps the LWS its model's passes read, so a
    claim is not taken for gone and a rolling LWS a new leader's pass read takes a slot, until
    a pass sees it settled or the model is gone."""
    models = [("ns", "lws"), ("ns", "other")]
    woken: list = []
    pacer = RolloutPacer(1, lambda: [], woken.append, models=lambda: models)
    key, other = models
    assert pacer.admit(key, "new", template_hash(_lws()), _lws()).admitted
    assert not pacer.admit(other, "new", "old", None).admitted  # the claim holds
    rolling_lws = _lws(paced=True, readyReplicas=0)
    labels = rolling_lws["metadata"]["labels"]
    labels[TEMPLATE_HASH] = labels[PACED] = "new"
    pacer.observe(key, rolling_lws)
    assert not pacer.admit(other, "new", "old", None).admitted and woken == []
    settled = copy.deepcopy(rolling_lws)
    settled["status"]["readyReplicas"] = 1
    pacer.observe(key, settled)
    assert woken == [[other]] and pacer.admit(other, "new", "old", None).admitted

    fresh = RolloutPacer(1, lambda: [], models=lambda: models)  # a new leader
    fresh.observe(key, rolling_lws)  # its first pass of the model read the LWS rolling
    assert not fresh.admit(other, "new", "old", None).admitted
    models.remove(key)  # the model was deleted: its LWS no longer counts
    assert fresh.admit(other, "new", "old", None).admitted


def _new_release_everywhere(monkeypatch):
    """A release that adds a pod annotation to the Deployment's template and to both of the
    LWS's (leader and worker)."""
    real = reconcile.desired_children

    def newer(model):
        out = real(model)
        if out["Deployment"] is not None:
            templates = [out["Deployment"]["spec"]["template"]]
        else:
            group = out[LWS]["spec"]["leaderWorkerTemplate"]
            templates = [group["leaderTemplate"], group["workerTemplate"]]
        for t in templates:
            t["metadata"].setdefault("annotations", {})["example.com/new-release"] = "true"
        return out

    monkeypatch.setattr(reconcile, "desired_children", newer)


def _settle(cluster, kind, name):
    cluster.set_deployment_status("default", name, kind=kind, replicas=1, readyReplicas=1,
                                  updatedReplicas=1, availableReplicas=1)  # fmt: skip


def test_a_release_rolls_deployments_and_lws_through_the_same_slots(monkeypatch):
    """One slot; m0 and m2 run on two nodes (LWS), m1 on one (Deployment). The release rolls
    m0's LWS, m1 and m2 wait in order; m0's settled LWS frees the slot for m1, whose
    Deployment then holds it against m2."""
    cluster = FakeCluster()
    bodies, kinds = [], {"m0": LWS, "m1": "Deployment", "m2": LWS}
    for name, kind in kinds.items():
        spec = minimal(**TWO_NODES) if kind == LWS else minimal()
        body = body_of(spec | {"metadata": {"name": name, "namespace": "default"}})
        converge(cluster, body, Events(), now=NOW)
        _settle(cluster, kind, name)
        bodies.append(with_status(body, cluster))
    _new_release_everywhere(monkeypatch)
    woken: list = []
    names = list(kinds)
    pacer = RolloutPacer(1, _memory_pacer(cluster, 1, [])._deployments, woken.append,
                         models=lambda: [("default", n) for n in names])  # fmt: skip

    def templates(name):
        spec = cluster.objects[(kinds[name], "default", name)]["spec"]
        if kinds[name] == LWS:
            group = spec["leaderWorkerTemplate"]
            return [group["leaderTemplate"], group["workerTemplate"]]
        return [spec["template"]]

    def new(name):
        marks = ["example.com/new-release" in t["metadata"].get("annotations", {})
                 for t in templates(name)]  # fmt: skip
        assert len(set(marks)) == 1  # leader and worker roll together
        return marks[0]

    def waiting(name):
        status = cluster.stored_status[("default", name)]
        return [c for c in status["conditions"] if c["type"] == "TemplateCurrent"]

    for body in bodies:
        converge(cluster, with_status(body, cluster), Events(), now=NOW, pacer=pacer)
    assert [new(n) for n in names] == [True, False, False]
    lws = cluster.objects[(LWS, "default", "m0")]
    assert lws["metadata"]["labels"][PACED] == lws["metadata"]["labels"][TEMPLATE_HASH]
    for name in ("m1", "m2"):
        (cond,) = waiting(name)
        assert "rolling now: default/m0" in cond["message"]
    # Still rolling (the LWS controller has not reported the new groups Ready): m2 waits.
    converge(cluster, with_status(bodies[2], cluster), Events(), now=NOW, pacer=pacer)
    assert not new("m2") and woken == []
    _settle(cluster, LWS, "m0")
    converge(cluster, with_status(bodies[0], cluster), Events(), now=NOW, pacer=pacer)
    assert woken == [[("default", "m1")]]
    for body in bodies[1:]:
        converge(cluster, with_status(body, cluster), Events(), now=NOW, pacer=pacer)
    assert [new(n) for n in names] == [True, True, False]
    assert not waiting("m1") and waiting("m2")
