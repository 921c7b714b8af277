"""Who can reach a router model's KV-event ports (5557, 5558: prompt token ids in clear,
no credentials), read from the NetworkPolicies the operator renders (`sluice-operator
render`), since the e2e harness enforces no policy.

`reachable` evaluates NetworkPolicy ingress as the API defines it (a pod selected by no
Ingress policy admits everything; a selected pod admits what any rule of any selecting
policy admits). Asserted for every peer and port below:

- the model's own policy off (the default): the events only from the router's pods, every
  other port exactly as reachable as with no policy at all (the server port too on a CNI
  that ignores `endPort`);
- the model's own policy on: the events only from the router's pods, and no other policy;
- the operator applies it, and deletes it once the model's own policy is on;
- negative controls: without the events policy (what the operator rendered before) any pod
  in the cluster reads the events; a model without the router, or on the simulator (no
  events), gets no such policy.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from operator_helpers import Events, FakeCluster, body_of, minimal, with_status
from sluice_operator.builders.kvevents import KV_EVENTS_PORT, KV_REPLAY_PORT, ROUTER_POD_LABELS
from sluice_operator.reconcile import converge
from sluice_operator.render import render_file
from sluice_operator.scaletozero import ZeroContext
from testkit.repo import ROOT

OPERATOR_NS = "sluice-system"  # the operator's namespace (DEFAULT_ACTIVATOR_HOST)
EVENTS = {("TCP", KV_EVENTS_PORT), ("TCP", KV_REPLAY_PORT)}
# Ports a model pod may be asked on: the server, the events, NCCL's and vLLM's run-time
# ports, the ends of the range, DNS-like UDP, SCTP.
PORTS = [("TCP", 8000), ("TCP", KV_EVENTS_PORT), ("TCP", KV_REPLAY_PORT), ("TCP", 1),
         ("TCP", 5556), ("TCP", 5559), ("TCP", 29500), ("TCP", 65535), ("UDP", 53),
         ("UDP", 5557), ("SCTP", 9999)]  # fmt: skip
TWO_NODES = {"resources": {"gpus": 8}, "parallelism": {"tensor": 8, "pipeline": 2, "nodes": 2}}


@dataclass(frozen=True)
class Peer:
    """A source of traffic: a pod (namespace, its labels) or, namespace None, an address
    outside the cluster's pods."""

    name: str
    namespace: str | None
    labels: dict[str, str] = field(default_factory=dict, hash=False)


def peers(model_ns: str, model_pod_labels: dict[str, str]) -> list[Peer]:
    router = {**ROUTER_POD_LABELS, "app.kubernetes.io/instance": "sluice"}
    return [
        Peer("router", OPERATOR_NS, router),
        Peer("operator", OPERATOR_NS, {"app.kubernetes.io/name": "sluice-operator"}),
        Peer("router-labels-elsewhere", "attacker", router),  # right labels, wrong namespace
        Peer("neighbour", model_ns, {"app": "notebook"}),
        Peer("model-pod", model_ns, model_pod_labels),
        Peer("other-namespace", "team-b", {"app": "anything"}),
        Peer("ingress", "ingress-nginx", {"app.kubernetes.io/name": "ingress-nginx"}),
        Peer("outside", None),
    ]


def _labels_match(selector: dict, labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        have = labels.get(e["key"])
        if e["operator"] == "In" and have not in e["values"]:
            return False
        if e["operator"] not in ("In",):
            raise AssertionError(f"operator {e['operator']} not evaluated here")
    return True


def _peer_matches(rule_peer: dict, policy_ns: str, peer: Peer) -> bool:
    assert "ipBlock" not in rule_peer  # not rendered by the operator
    if peer.namespace is None:
        return False
    ns_sel, pod_sel = rule_peer.get("namespaceSelector"), rule_peer.get("podSelector")
    if ns_sel is None:  # the policy's own namespace
        in_ns = peer.namespace == policy_ns
    else:
        in_ns = _labels_match(ns_sel, {"kubernetes.io/metadata.name": peer.namespace})
    return in_ns and (pod_sel is None or _labels_match(pod_sel, peer.labels))


def _port_matches(entry: dict, protocol: str, port: int, end_port: bool) -> bool:
    if entry.get("protocol", "TCP") != protocol:
        return False
    if "port" not in entry:
        return True
    first = entry["port"]
    last = entry.get("endPort", first) if end_port else first
    return first <= port <= last


def reachable(policies: list[dict], pod_ns: str, pod_labels: dict[str, str], peer: Peer,
              protocol: str, port: int, *, end_port: bool = True) -> bool:  # fmt: skip
    """Whether `peer` may open `protocol`/`port` on a pod (`end_port` False: as a CNI that
    ignores `endPort` does, the first port of each range only)."""
    selecting = [
        p for p in policies
        if p["metadata"]["namespace"] == pod_ns
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        and _labels_match(p["spec"]["podSelector"], pod_labels)
    ]  # fmt: skip
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            sources = rule.get("from") or []
            ports = rule.get("ports") or []
            if sources and not any(_peer_matches(s, pod_ns, peer) for s in sources):
                continue
            if ports and not any(_port_matches(e, protocol, port, end_port) for e in ports):
                continue
            return True
    return False


def rendered(tmp_path: Path, body: dict) -> tuple[list[dict], dict[str, str], str]:
    """The NetworkPolicies of `sluice-operator render` on the model, its pods' labels (the
    first workload's pod template) and its namespace."""
    src = tmp_path / "model.yaml"
    src.write_text(yaml.safe_dump(body))
    docs = [d for d in yaml.safe_load_all(render_file(src)) if d]
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    workload = next(d for d in docs if d["kind"] in ("Deployment", "LeaderWorkerSet"))
    spec = workload["spec"]
    template = spec["template"] if "template" in spec else (
        spec["leaderWorkerTemplate"]["leaderTemplate"])  # fmt: skip
    return policies, template["metadata"]["labels"], body["metadata"]["namespace"]


def reach_table(policies, ns, labels, *, end_port=True) -> dict[tuple[str, str, int], bool]:
    return {(peer.name, proto, port): reachable(policies, ns, labels, peer, proto, port,
                                                end_port=end_port)
            for peer in peers(ns, labels) for proto, port in PORTS}  # fmt: skip


def sample_body() -> dict:
    (doc,) = [d for d in yaml.safe_load_all((ROOT / "samples" / "router.yaml").read_text()) if d]
    return body_of(doc, namespace=doc["metadata"]["namespace"])


def events_readers(table) -> set[str]:
    return {peer for (peer, proto, port), ok in table.items() if ok and (proto, port) in EVENTS}


def test_with_the_models_policy_off_only_the_router_reads_the_events(tmp_path):
    policies, labels, ns = rendered(tmp_path, sample_body())
    assert [p["metadata"]["name"] for p in policies] == ["chat-routed-kv-events"]
    table = reach_table(policies, ns, labels)
    assert events_readers(table) == {"router"}
    # Every other port is exactly as reachable as with no policy at all: from everyone.
    assert all(ok for (peer, proto, port), ok in table.items() if (proto, port) not in EVENTS)
    # A CNI that ignores endPort still serves the model's port to everyone (and still
    # keeps the events to the router).
    degraded = reach_table(policies, ns, labels, end_port=False)
    assert all(degraded[(p.name, "TCP", 8000)] for p in peers(ns, labels))
    assert events_readers(degraded) == {"router"}
    # Negative control: without it (what the operator rendered before), the events are open
    # to everyone.
    before = reach_table([], ns, labels)
    assert events_readers(before) == {p.name for p in peers(ns, labels)}


def test_with_the_models_policy_on_it_alone_restricts_the_events(tmp_path):
    body = sample_body()
    body["spec"]["networkPolicy"] = {"enabled": True}
    policies, labels, ns = rendered(tmp_path, body)
    assert [p["metadata"]["name"] for p in policies] == ["chat-routed"]  # no second policy
    table = reach_table(policies, ns, labels)
    assert events_readers(table) == {"router"}
    # The server port: the model's namespace, the proxies', the operator's (the router).
    assert {peer for (peer, proto, port), ok in table.items() if ok and port == 8000} == {
        "router", "operator", "neighbour", "model-pod", "ingress"}  # fmt: skip


def test_a_multi_node_model_keeps_its_pods_talking_on_every_port(tmp_path):
    body = body_of(minimal(routing={"router": {"enabled": True}}, **TWO_NODES))
    policies, labels, ns = rendered(tmp_path, body)
    assert [p["metadata"]["name"] for p in policies] == ["m-kv-events"]
    table = reach_table(policies, ns, labels)
    # The group's own pods (leader <-> workers) as without a policy, on every port.
    assert events_readers(table) == {"router", "model-pod"}
    assert all(ok for (peer, proto, port), ok in table.items() if (proto, port) not in EVENTS)


@pytest.mark.parametrize(
    "spec",
    [
        {},  # no router
        {"routing": {"router": {"enabled": True}}, "engine": {"backend": "simulator"}},
    ],
    ids=["no-router", "simulator-router"],
)
def test_models_without_events_get_no_events_policy(tmp_path, spec):
    policies, labels, ns = rendered(tmp_path, body_of(minimal(**copy.deepcopy(spec))))
    assert policies == []
    assert all(reach_table(policies, ns, labels).values())


def test_the_operator_applies_it_and_deletes_it_once_the_models_own_policy_is_on():
    cluster, events = FakeCluster(), Events()
    zero = ZeroContext(activator_host=f"sluice-activator.{OPERATOR_NS}.svc.cluster.local")
    body = body_of(minimal(routing={"router": {"enabled": True}}))
    out = converge(cluster, body, events, now="2026-12-01T06:00:00Z", zero=zero)
    assert "KvEventsNetworkPolicy" in out.applied
    assert ("NetworkPolicy", "default", "m-kv-events") in cluster.objects
    assert ("NetworkPolicy", "default", "m") not in cluster.objects
    body["spec"]["networkPolicy"] = {"enabled": True}
    body["metadata"]["generation"] = 2
    out = converge(cluster, with_status(body, cluster), events, now="2026-12-01T06:00:01Z",
                   zero=zero)  # fmt: skip
    assert "KvEventsNetworkPolicy" in out.deleted
    assert ("NetworkPolicy", "default", "m-kv-events") not in cluster.objects
    assert ("NetworkPolicy", "default", "m") in cluster.objects
