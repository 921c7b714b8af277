"""The chart's namespaced RBAC on a real API server (the e2e suite covers cluster-wide mode).

Renders charts/sluice-operator with `watch.allNamespaces=false` for two namespaces, applies
its ServiceAccount, Roles and bindings as rendered, and runs the real operator with a token
of that ServiceAccount (the e2e harness in testing/e2e_harness). The operator must build the
children of a model in a watched namespace with no RBAC denial in the audit log, and leave a
model in an unwatched namespace alone. Negative control: with the write verbs of
`services` removed from one Role, the audit log shows the operator denied writing the
Service there and that namespace gets no Service. (Reading every child kind is not
optional: the operator serves passes from watches of each kind in every watched namespace,
and stops at start-up, saying which list was forbidden, when one is denied.)

Needs K8S_ASSETS (kube-apiserver, kube-controller-manager, kube-scheduler) and etcd, like
tests/e2e; otherwise skipped with one line.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

OPERATOR_NS = "sluice-system"
WATCHED = ("team-a", "team-b")


def _denials(cp, user: str, since: int = 0) -> list[tuple[str, str, str]]:
    return [
        (
            e["verb"],
            e.get("objectRef", {}).get("resource", ""),
            e.get("objectRef", {}).get("namespace", ""),
        )
        for e in cp.audit_events(user=user, since=since)
        if e.get("annotations", {}).get("authorization.k8s.io/decision") == "forbid"
    ]


def test_namespaced_rbac_on_a_real_api_server(live_cluster):
    from e2e_harness.kube import Models, eventually, load_sample
    from e2e_harness.operator_process import (
        OperatorProcess,
        RenderedChart,
        install_operator_identity,
    )
    from kubernetes import client

    cp, admin = live_cluster
    op = None
    try:
        core = client.CoreV1Api(admin)
        for ns in (*WATCHED, "unwatched"):
            core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))

        chart = RenderedChart.render(
            OPERATOR_NS,
            values={"watch.allNamespaces": "false", "watch.namespaces": "{team-a,team-b}"},
        )
        watched_roles = [
            r
            for r in chart.of_kind("Role")
            if not r["metadata"]["name"].endswith(("-election", "-activator"))
        ]
        assert {r["metadata"]["namespace"] for r in watched_roles} == set(WATCHED)
        assert not chart.of_kind("ClusterRoleBinding")  # nothing cluster-scoped for the operator
        # Negative control: team-b's Role may read services but not write them.
        (role_b,) = [r for r in watched_roles if r["metadata"]["namespace"] == "team-b"]
        (services,) = [r for r in role_b["rules"] if r["resources"] == ["services"]]
        services["verbs"] = ["get", "list", "watch"]
        kubeconfig = install_operator_identity(admin, cp, chart)
        ns, sa = chart.service_account()
        user = f"system:serviceaccount:{ns}:{sa}"
        op = OperatorProcess(chart, kubeconfig, cp.logs).start()
        assert "--namespace=team-a" in op.argv and "--namespace=team-b" in op.argv

        models = Models(admin)
        for namespace in ("team-a", "unwatched"):
            models.create(load_sample("chat-small.yaml", namespace))
        kids = eventually(
            lambda: (
                (c := models.children("team-a", "chat-small"))["Deployment"] and c["Service"] and c
            ),
            timeout=60,
            message="children in team-a",
        )
        assert kids["Deployment"].metadata.owner_references[0].kind == "StreamingModel"
        eventually(
            lambda: models.get("team-a", "chat-small").get("status"),
            timeout=30,
            message="status in team-a",
        )
        # Only team-b (the negative control) may see denials: its Service apply fails.
        denied = _denials(cp, user)
        assert [d for d in denied if d[2] != "team-b"] == [], (
            "the chart is missing something the operator uses"
        )
        assert {d[1] for d in denied} <= {"services"}, denied

        mark = cp.audit_mark()
        models.create(load_sample("chat-small.yaml", "team-b"))
        eventually(
            lambda: ("patch", "services", "team-b") in _denials(cp, user, since=mark),
            timeout=60,
            message="the services denial in team-b",
        )
        assert models.children("team-b", "chat-small")["Service"] is None
        # The unwatched namespace was never touched: no call of the operator there at all.
        assert not [
            e
            for e in cp.audit_events(user=user)
            if e.get("objectRef", {}).get("namespace") == "unwatched"
        ]
        assert all(c is None for c in models.children("unwatched", "chat-small").values())
    finally:
        if op is not None:
            op.stop()
