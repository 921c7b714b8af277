"""Models on several nodes per replica (`spec.parallelism.nodes > 1`): a LeaderWorkerSet
instead of a Deployment, rendered from the same pod, with the Service on the leaders, the
HPA / KEDA on the LWS's scale subresource, and a pass that never leaves both workloads."""

from __future__ import annotations

import copy

import jsonschema
import kubernetes_validate
import pytest
from operator_helpers import FakeCluster, body_of, minimal, validate_manifest, with_status
from sluice_operator.builders.args import ENGINE_MASTER_PORT
from sluice_operator.builders.deployment import desired_deployment, pod_template
from sluice_operator.builders.keda import pod_matchers
from sluice_operator.builders.leaderworkerset import desired_leaderworkerset
from sluice_operator.reconcile import converge
from sluice_operator.render import render_objects
from sluice_operator.status_from_cluster import compute_status
from sluice_operator.validation import load_model
from testkit.k8s import K8S_VERSIONS
from testkit.repo import LWS_CRD, shared_crd

NOW = "2026-12-01T06:00:00Z"
TWO_NODES = {"resources": {"gpus": 8}, "parallelism": {"tensor": 8, "pipeline": 2, "nodes": 2}}


def model(**spec):
    return load_model(minimal(**spec))


def by_kind(body: dict) -> dict[str, dict]:
    return {m["kind"]: m for m in render_objects(copy.deepcopy(body))}


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_two_nodes_render_a_leaderworkerset_and_no_deployment():
    out = by_kind(minimal(**TWO_NODES, replicas=3))
    assert "Deployment" not in out
    lws = out["LeaderWorkerSet"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    spec = lws["spec"]
    assert spec["replicas"] == 3
    assert spec["startupPolicy"] == "LeaderCreated"
    assert spec["rolloutStrategy"]["rollingUpdateConfiguration"] == {
        "maxSurge": 1,
        "maxUnavailable": 0,
    }
    group = spec["leaderWorkerTemplate"]
    assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    # One node: the Deployment as before, no LWS.
    one = by_kind(minimal())
    assert "LeaderWorkerSet" not in one and "Deployment" in one


def test_leader_is_the_deployments_pod_with_rank_zero_and_workers_run_headless_ranks():
    m = model(**TWO_NODES)
    group = desired_leaderworkerset(m)["spec"]["leaderWorkerTemplate"]
    (leader,) = group["leaderTemplate"]["spec"]["containers"]
    (worker,) = group["workerTemplate"]["spec"]["containers"]
    for args, rank in ((leader["args"], "0"), (worker["args"], "$(LWS_WORKER_INDEX)")):
        assert flag(args, "--nnodes") == "2" and flag(args, "--node-rank") == rank
        assert flag(args, "--master-addr") == "$(LWS_LEADER_ADDRESS)"
        assert flag(args, "--master-port") == str(ENGINE_MASTER_PORT)
        assert flag(args, "--tensor-parallel-size") == "8"
        assert flag(args, "--pipeline-parallel-size") == "2"
    # The leader serves HTTP with the Deployment's probes; the worker serves nothing.
    assert leader["readinessProbe"]["httpGet"]["path"] == "/ready" and leader["ports"]
    assert not {"ports", "readinessProbe", "livenessProbe", "startupProbe"} & set(worker)
    assert "--protocols" in leader["args"] and "--protocols" not in worker["args"]
    # Each pod of the group holds a node's GPUs.
    for c in (leader, worker):
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
    # The worker outlives the leader's drain (its preStop waits as long).
    grace = group["workerTemplate"]["spec"]["terminationGracePeriodSeconds"]
    wait = worker["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert wait >= leader["lifecycle"]["preStop"]["sleep"]["seconds"] and wait < grace


def test_leader_template_is_the_one_node_pod_plus_its_role():
    m = model(**TWO_NODES)
    leader = desired_leaderworkerset(m)["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    plain = pod_template(m)
    plain["metadata"]["labels"]["serving.sluice.dev/role"] = "leader"
    assert leader == plain


def test_service_selects_leaders_and_autoscalers_target_the_lws():
    out = by_kind(minimal(**TWO_NODES, autoscaling={"maxReplicas": 3}))
    assert out["Service"]["spec"]["selector"]["serving.sluice.dev/role"] == "leader"
    target = out["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert target == {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "name": "m",
    }
    assert "replicas" not in out["LeaderWorkerSet"]["spec"]  # the HPA owns it
    keda = by_kind(minimal(**TWO_NODES, autoscaling={"backend": "keda", "maxReplicas": 3}))
    assert keda["ScaledObject"]["spec"]["scaleTargetRef"]["kind"] == "LeaderWorkerSet"
    # KEDA's query reads the leaders' metrics: <name>-<group>, not the workers'.
    assert 'pod=~"m-[0-9]+"' in pod_matchers(model(**TWO_NODES))
    one = by_kind(minimal())
    assert "serving.sluice.dev/role" not in one["Service"]["spec"]["selector"]


def test_exclusive_placement_is_lws_exclusive_topology():
    spec = copy.deepcopy(TWO_NODES)
    spec["parallelism"]["exclusiveTopologyKey"] = "network.example.com/rack"
    lws = desired_leaderworkerset(model(**spec))
    annotations = lws["metadata"]["annotations"]
    assert annotations == {
        "leaderworkerset.sigs.k8s.io/exclusive-topology": "network.example.com/rack"
    }
    assert "annotations" not in desired_leaderworkerset(model(**TWO_NODES))["metadata"]


def test_derived_api_workers_is_one_on_several_nodes():
    m = model(**{**TWO_NODES, "resources": {"gpus": 8, "requests": {"cpu": "16"}}})
    (leader,) = desired_leaderworkerset(m)["spec"]["leaderWorkerTemplate"]["leaderTemplate"][
        "spec"
    ]["containers"]
    assert "--api-workers" not in leader["args"]
    one = desired_deployment(model(resources={"requests": {"cpu": "16"}}))
    assert one is not None
    assert "--api-workers" in one["spec"]["template"]["spec"]["containers"][0]["args"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_rendered_lws_validates_and_the_check_has_teeth(version):
    lws = desired_leaderworkerset(model(**TWO_NODES))
    validate_manifest(lws, version)
    # Negative controls: an unknown pod field (always checked) and, with the official CRD
    # here, an unknown LWS field and a wrong enum fail.
    bad_pod = copy.deepcopy(lws)
    bad_pod["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containerz"] = []
    with pytest.raises(kubernetes_validate.ValidationError, match="containerz"):
        validate_manifest(bad_pod, version)
    if shared_crd(LWS_CRD) is None:
        return
    for field, value, error in (
        ("sizes", 2, AssertionError),  # unknown: the API server would prune it
        ("restartPolicy", "Always", jsonschema.ValidationError),  # not in the enum
    ):
        bad = copy.deepcopy(lws)
        bad["spec"]["leaderWorkerTemplate"][field] = value
        with pytest.raises(error, match=field if error is AssertionError else value):
            validate_manifest(bad, version)


def _workloads(cluster: FakeCluster) -> set[str]:
    return {k[0] for k in cluster.objects} & {"Deployment", "LeaderWorkerSet"}


def test_switching_nodes_replaces_the_workload_and_never_keeps_both():
    cluster = FakeCluster()
    body = body_of(minimal())
    converge(cluster, body, lambda *a: None, now=NOW)
    assert _workloads(cluster) == {"Deployment"}
    for spec, want in ((TWO_NODES, {"LeaderWorkerSet"}), ({}, {"Deployment"})):
        body = with_status(body, cluster)
        body["spec"] = minimal(**spec)["spec"]
        body["metadata"]["generation"] += 1
        converge(cluster, body, lambda *a: None, now=NOW)
        assert _workloads(cluster) == want
        # A second pass changes nothing (converged).
        before = copy.deepcopy(cluster.objects)
        converge(cluster, with_status(body, cluster), lambda *a: None, now=NOW)
        assert _workloads(cluster) == want and cluster.objects.keys() == before.keys()


def test_status_counts_groups_from_the_lws():
    m = model(**TWO_NODES, replicas=2)
    lws = {
        "metadata": {"generation": 1},
        "spec": {"replicas": 2},
        "status": {"replicas": 2, "readyReplicas": 1, "updatedReplicas": 2},
    }
    status = compute_status(m, 1, lws, now=NOW)
    assert status["ready"] == "1/2" and status["message"] == "1/2 groups ready"
    assert compute_status(m, 1, None, now=NOW)["message"] == "creating the LeaderWorkerSet"


def test_network_policy_lets_a_groups_pods_reach_each_other_on_any_port():
    out = by_kind(minimal(**TWO_NODES, networkPolicy={"enabled": True}))
    served, group = out["NetworkPolicy"]["spec"]["ingress"]
    assert served["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert "ports" not in group
    own = {"app.kubernetes.io/name": "sluice-server", "app.kubernetes.io/instance": "m"}
    assert group["from"] == [{"podSelector": {"matchLabels": own}}]
    one = by_kind(minimal(networkPolicy={"enabled": True}))
    assert len(one["NetworkPolicy"]["spec"]["ingress"]) == 1


def _matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


@pytest.mark.parametrize("unavailable", [0, 1, 2])
def test_pdb_covers_every_pod_of_every_group(unavailable):
    """One budget over leaders and workers: an evicted pod recreates its group, whose pods
    are then all unavailable, so a drain takes a group at a time (more with maxUnavailable
    above the group size)."""
    rollout = {"maxSurge": 1 if unavailable == 0 else 0, "maxUnavailable": unavailable}
    out = by_kind(minimal(**TWO_NODES, replicas=3, rollout=rollout))
    pdb = out["PodDisruptionBudget"]["spec"]
    assert pdb["maxUnavailable"] == max(1, unavailable)
    group = out["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    for role in ("leaderTemplate", "workerTemplate"):
        assert _matches(pdb["selector"], group[role]["metadata"]["labels"]), role
    # Negative control: a selector with the leaders' role label would miss the workers.
    leaders = {
        "matchLabels": {**pdb["selector"]["matchLabels"], "serving.sluice.dev/role": "leader"}
    }
    assert not _matches(leaders, group["workerTemplate"]["metadata"]["labels"])
    # One group: a budget would block every drain or protect nothing, as with one pod.
    assert "PodDisruptionBudget" not in by_kind(minimal(**TWO_NODES, replicas=1))


def test_network_policy_peers_select_the_workers_too():
    """The group rule admits traffic from and to every pod of the model, leaders and workers
    (the engine's rendezvous, NCCL/gloo and message-queue ports are picked at run time)."""
    out = by_kind(minimal(**TWO_NODES, networkPolicy={"enabled": True}))
    spec = out["NetworkPolicy"]["spec"]
    group = out["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    (peer,) = spec["ingress"][1]["from"]
    for role in ("leaderTemplate", "workerTemplate"):
        labels = group[role]["metadata"]["labels"]
        assert _matches(spec["podSelector"], labels) and _matches(peer["podSelector"], labels)


def test_a_starting_lws_makes_the_handler_read_it_again_until_its_groups_are_ready(monkeypatch):
    """LeaderWorkerSets are not watched, so the model's handler looks again soon while the
    LWS's groups are not all updated and Ready; the status then counts them."""
    import logging

    import kopf
    from sluice_operator import handlers, passes

    monkeypatch.setattr(kopf, "event", lambda body, **kw: None)
    cluster = FakeCluster()
    body = body_of(minimal(**TWO_NODES))
    cluster.store(body)
    kwargs = dict(body=body, namespace="default", name="m", memo=cluster.memo, retry=0,
                  logger=logging.getLogger("test"))  # fmt: skip
    with pytest.raises(kopf.TemporaryError) as exc:
        handlers.reconcile(**kwargs)  # created: the LWS controller has not reported yet
    assert exc.value.delay == passes.WORKLOAD_RECHECK_SECONDS
    assert cluster.stored_status[("default", "m")]["ready"] == "0/1"
    cluster.set_deployment_status("default", "m", kind="LeaderWorkerSet", replicas=1,
                                  readyReplicas=1, updatedReplicas=1)  # fmt: skip
    handlers.reconcile(**kwargs)  # settled: no retry
    status = cluster.stored_status[("default", "m")]
    assert status["ready"] == "1/1" and status["message"] == "1/1 groups ready"
    # A one-node model's Deployment is watched: no such retry (its events start passes).
    one = FakeCluster()
    plain = body_of(minimal())
    one.store(plain)
    handlers.reconcile(**{**kwargs, "body": plain, "memo": one.memo})
