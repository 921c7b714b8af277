"""charts/sluice-operator rendered by the real helm binary: lint, template, schema
validation for two Kubernetes versions, secure defaults, RBAC, and each flag both set and
not rendered."""

from __future__ import annotations

import base64
import filecmp
import json
import tarfile
from pathlib import Path

import pytest
import yaml
from sluice_operator.generate import chartdocs
from testkit.repo import ROOT

from .chartlib import (
    CRD_FILE,
    HERE,
    MODEL_CHART,
    OPERATOR_CHART,
    activator_docs,
    by_kind,
    documented_keys,
    one,
    validate_k8s,
)

ALL_ON = HERE / "values-all-on.yaml"
NAMESPACED = ["watch.allNamespaces=false", "watch.namespaces={team-a,team-b}"]


# ---- lint and render -------------------------------------------------------------------


@pytest.mark.parametrize(
    "values,set_",
    [([], []), ([ALL_ON], []), ([], NAMESPACED), ([ALL_ON], NAMESPACED)],
    ids=["defaults", "all-on", "namespaced", "all-on-namespaced"],
)
def test_lint_strict(h, values, set_):
    args = ["lint", "--strict", str(OPERATOR_CHART)]
    for v in values:
        args += ["-f", str(v)]
    for s in set_:
        args += ["--set", s]
    out = h.run(*args).stdout
    assert "0 chart(s) failed" in out
    assert "[WARNING]" not in out and "[ERROR]" not in out


@pytest.mark.parametrize(
    "values,set_",
    [([], []), ([ALL_ON], []), ([], NAMESPACED), ([ALL_ON], NAMESPACED)],
    ids=["defaults", "all-on", "namespaced", "all-on-namespaced"],
)
def test_every_manifest_validates(h, values, set_):
    docs = h.template(OPERATOR_CHART, values=values, set_=set_, include_crds=True)
    assert len(docs) >= 6
    for doc in docs:
        validate_k8s(doc)


def test_default_objects(h):
    docs = h.template(OPERATOR_CHART)
    activator = activator_docs(docs)
    assert sorted(d["kind"] for d in activator) == [
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "Secret",
        "Secret",
        "Service",
        "ServiceAccount",
    ]  # fmt: skip  (the pin key and the continuation key)
    docs = [d for d in docs if d not in activator]
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        [
            "ServiceAccount",
            "ConfigMap",
            "ClusterRole",
            "ClusterRole",
            "ClusterRole",
            "ClusterRoleBinding",
            "Deployment",
            "Role",
            "Role",
            "RoleBinding",
            "RoleBinding",
            "PodDisruptionBudget",
        ]
    )
    for doc in docs:
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "sluice-operator"
        assert labels["app.kubernetes.io/instance"] == "sluice"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["helm.sh/chart"] == "sluice-operator-0.1.0"


def test_chart_crd_is_the_generated_crd(h):
    chart_crd = OPERATOR_CHART / "crds" / CRD_FILE.name
    assert chart_crd.is_file(), "the operator's generator writes the chart's CRD copy"
    assert filecmp.cmp(chart_crd, CRD_FILE, shallow=False), "run `make crds`"
    assert list((OPERATOR_CHART / "crds").iterdir()) == [chart_crd]
    docs = h.template(OPERATOR_CHART, include_crds=True)
    crd = one(docs, "CustomResourceDefinition")
    assert crd == yaml.safe_load(CRD_FILE.read_text())
    # Helm only installs crds/ on first install and never templates them otherwise.
    assert not by_kind(h.template(OPERATOR_CHART), "CustomResourceDefinition")


# ---- the Deployment -----------------------------------------------------------------------


def _container(docs):
    deploy = one(docs, "Deployment")
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    return deploy, container


def test_deployment_runs_the_operator_with_kopf_health(h):
    deploy, c = _container(h.template(OPERATOR_CHART))
    assert c["command"] == ["python", "-m", "sluice_operator", "run"]
    assert c["args"] == [
        "--all-namespaces",
        "--leader-elect",
        "--leader-elect-resource-name=sluice-sluice-operator",
        "--leader-elect-resource-namespace=sluice-system",
        "--leader-elect-lease-duration=15",
        "--leader-elect-renew-deadline=10",
        "--leader-elect-retry-period=2",
        "--standalone",
        "--liveness=http://0.0.0.0:8080/healthz",
        "--log-format=json",
        "--max-concurrent-model-rollouts=2",
        "--metrics-port=8081",
        "--activator-service=sluice-activator",
        "--activator-namespace=sluice-system",
        "--activator-selector=app.kubernetes.io/component=activator,app.kubernetes.io/instance=sluice",
        "--continuation-key-file=/etc/sluice/continuation/master",
    ]
    assert c["image"] == "ghcr.io/sluice-dev/sluice-operator:0.1.0"
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert c["ports"] == [{"name": "health", "containerPort": 8080, "protocol": "TCP"},
                          {"name": "metrics", "containerPort": 8081, "protocol": "TCP"}]  # fmt: skip
    notes = deploy["spec"]["template"]["metadata"]["annotations"]
    assert (notes["prometheus.io/scrape"], notes["prometheus.io/port"]) == ("true", "8081")
    deploy, c = _container(h.template(OPERATOR_CHART, set_=["operator.metricsPort=0"]))
    assert not any(a.startswith("--metrics") for a in c["args"]) and len(c["ports"]) == 1
    assert "prometheus.io/scrape" not in deploy["spec"]["template"]["metadata"]["annotations"]
    deploy, c = _container(h.template(OPERATOR_CHART))
    # Two electing replicas; a new pod starts as a standby before an old one goes.
    assert deploy["spec"]["replicas"] == 2
    assert deploy["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    annotations = deploy["spec"]["template"]["metadata"]["annotations"]
    assert annotations["sluice.dev/leader-election"] == "true"
    spec = deploy["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == "sluice-sluice-operator"


def test_operator_cli_accepts_the_rendered_arguments(h):
    """The chart's args parse with the operator's own CLI (no cluster needed)."""
    cli = pytest.importorskip("sluice_operator.cli")
    for set_ in ([], NAMESPACED):
        _, c = _container(h.template(OPERATOR_CHART, set_=set_))
        args = cli.build_parser().parse_args([*c["command"][3:], *c["args"]])
        assert args.command == "run"
        assert args.liveness == "http://0.0.0.0:8080/healthz"
        assert args.standalone is True and args.peering is None
        assert args.log_format == "json" and args.verbose is False
        if set_:
            assert args.namespace == ["team-a", "team-b"] and not args.all_namespaces
        else:
            assert args.all_namespaces and not args.namespace
        assert args.max_concurrent_model_rollouts == 2
        election = cli.election_settings(args)  # refuses unsafe timing with ValueError
        assert (election.name, election.namespace) == ("sluice-sluice-operator", "sluice-system")
        assert (election.lease_duration, election.renew_deadline, election.retry_period) == (
            15,
            10,
            2,
        )
    _, c = _container(
        h.template(
            OPERATOR_CHART,
            set_=["peering.enabled=true", "operator.verbose=true", "operator.logFormat=plain"],
        )
    )
    args = cli.build_parser().parse_args([*c["command"][3:], *c["args"]])
    assert args.peering == "sluice-operator" and not args.standalone
    assert args.verbose is True and args.log_format == "plain"


def test_secure_defaults(h):
    deploy, c = _container(h.template(OPERATOR_CHART))
    pod = deploy["spec"]["template"]["spec"]["securityContext"]
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] > 0
    assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["privileged"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    # the only writable path is a bounded emptyDir at /tmp
    # The only writable path; the rest (the continuation key) read-only.
    assert c["volumeMounts"][0] == {"name": "tmp", "mountPath": "/tmp"}
    assert all(m.get("readOnly") for m in c["volumeMounts"][1:])
    vol, key = deploy["spec"]["template"]["spec"]["volumes"]
    assert vol["emptyDir"]["sizeLimit"] and key["secret"]["defaultMode"] == 0o440


@pytest.mark.parametrize("values", [[], [ALL_ON]], ids=["defaults", "all-on"])
def test_no_workload_takes_a_secret_through_env(h, values):
    """The operator and the activator, like the model pods the operator renders
    (tests/operator/test_operator_secrets.py): no secretKeyRef in env, no envFrom secretRef."""
    workloads = [
        d for d in h.template(OPERATOR_CHART, values=values) if "template" in d.get("spec", {})
    ]
    assert {d["kind"] for d in workloads} == {"Deployment"} and len(workloads) == 2
    for d in workloads:
        pod = d["spec"]["template"]["spec"]
        for c in pod["containers"] + pod.get("initContainers", []):
            env = [e["name"] for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})]
            env_from = [e for e in c.get("envFrom", []) if "secretRef" in e]
            assert not env and not env_from, f"{d['metadata']['name']}/{c['name']}"


def test_config_checksum_rolls_pods_only_on_config_change(h):
    def checksum(set_):
        deploy, _ = _container(h.template(OPERATOR_CHART, set_=set_))
        return deploy["spec"]["template"]["metadata"]["annotations"]["checksum/config"]

    base = checksum([])
    assert len(base) == 64
    assert checksum(["operator.env.FOO=bar"]) != base
    assert checksum(["nodeSelector.disk=ssd"]) == base  # not config: same checksum


def test_config_map_carries_extra_env(h):
    docs = h.template(OPERATOR_CHART, set_=["operator.env.FOO=bar"])
    cm = one(docs, "ConfigMap")
    assert cm["data"]["FOO"] == "bar"
    _, c = _container(docs)
    assert c["envFrom"] == [{"configMapRef": {"name": cm["metadata"]["name"]}}]


def _model_defaults(docs, monkeypatch):
    """What the operator run by the rendered Deployment makes of its ConfigMap's
    environment and its arguments: its `--model-image`, as `OperatorDefaults`."""
    cli = pytest.importorskip("sluice_operator.cli")
    _, c = _container(docs)
    for key, value in one(docs, "ConfigMap")["data"].items():
        monkeypatch.setenv(key, value)
    return cli.operator_defaults(cli.build_parser().parse_args([*c["command"][3:], *c["args"]]))


def test_model_image_not_set_is_the_operators_built_in_default(h, monkeypatch):
    """Not set: the Sluice server at the chart's appVersion, the operator's own default, so
    installing or upgrading the chart with default values rolls no model."""
    from sluice_operator.models.resource import DEFAULT_MODEL_IMAGE

    docs = h.template(OPERATOR_CHART)
    chart = yaml.safe_load((OPERATOR_CHART / "Chart.yaml").read_text())
    want = f"ghcr.io/sluice-dev/sluice-server:{chart['appVersion']}"
    assert one(docs, "ConfigMap")["data"]["SLUICE_OPERATOR_MODEL_IMAGE"] == want
    _, c = _container(docs)
    assert not [a for a in c["args"] if a.startswith("--model-image")]
    monkeypatch.delenv("SLUICE_OPERATOR_MODEL_IMAGE", raising=False)
    assert _model_defaults(docs, monkeypatch).model_image == want == DEFAULT_MODEL_IMAGE


def test_model_image_set_reaches_the_operator_and_rolls_its_pod(h, monkeypatch):
    """A private registry is one value; the tag defaults to appVersion; a changed model
    image restarts the operator with it (the config checksum)."""
    repo = "registry.example.com:5000/sluice/sluice-server"
    base = h.template(OPERATOR_CHART)
    docs = h.template(OPERATOR_CHART, set_=[f"modelImage.repository={repo}"])
    assert _model_defaults(docs, monkeypatch).model_image == f"{repo}:0.1.0"
    docs_tag = h.template(OPERATOR_CHART, set_=[f"modelImage.repository={repo}",
                                                "modelImage.tag=1.2.3-rc.1"])  # fmt: skip
    assert _model_defaults(docs_tag, monkeypatch).model_image == f"{repo}:1.2.3-rc.1"
    sums = [
        _container(d)[0]["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
        for d in (base, docs, docs_tag)
    ]
    assert len(set(sums)) == 3
    err = h.template_error(OPERATOR_CHART, set_=["modelImage.repository="])
    assert "modelImage" in err


def test_scheduling_values_set_and_not_rendered(h):
    deploy, _ = _container(h.template(OPERATOR_CHART, set_=["podAntiAffinity="]))
    spec = deploy["spec"]["template"]["spec"]
    for key in (
        "nodeSelector",
        "tolerations",
        "affinity",
        "topologySpreadConstraints",
        "priorityClassName",
        "imagePullSecrets",
    ):
        assert key not in spec, key
    deploy, c = _container(h.template(OPERATOR_CHART, values=[ALL_ON]))
    spec = deploy["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert spec["tolerations"][0]["key"] == "CriticalAddonsOnly"
    assert "podAntiAffinity" in spec["affinity"]
    assert spec["topologySpreadConstraints"][0]["maxSkew"] == 1
    assert spec["priorityClassName"] == "system-cluster-critical"
    assert spec["imagePullSecrets"] == [{"name": "registry-creds"}]
    assert c["image"].endswith("@sha256:" + "0123456789abcdef" * 4)
    assert deploy["spec"]["template"]["metadata"]["labels"]["tier"] == "control"
    assert deploy["spec"]["template"]["metadata"]["annotations"]["example.com/owner"] == "platform"
    assert "--verbose" in c["args"] and c["args"][-1] == "--some-extra-flag"


def test_peering_set_and_not_rendered(h):
    docs = h.template(OPERATOR_CHART)
    _, c = _container(docs)
    assert "--standalone" in c["args"] and not any(a.startswith("--peering") for a in c["args"])
    assert "kopf.dev" not in yaml.safe_dump(docs)

    docs = h.template(OPERATOR_CHART, set_=["peering.enabled=true"])
    deploy, c = _container(docs)
    assert "--peering=sluice-operator" in c["args"] and "--standalone" not in c["args"]
    # peering (pausing for a higher-priority operator) goes with leader election
    assert "--leader-elect" in c["args"] and deploy["spec"]["replicas"] == 2
    rules = _operator_role(docs)["rules"]
    assert {
        "apiGroups": ["kopf.dev"],
        "resources": ["clusterkopfpeerings"],
        "verbs": ["get", "list", "watch", "patch"],
    } in rules

    docs = h.template(OPERATOR_CHART, set_=["peering.enabled=true", *NAMESPACED])
    # The last are the activator's and the election's (the router's own are apart).
    for role in by_kind(_not_router(docs), "Role")[:-2]:
        assert {
            "apiGroups": ["kopf.dev"],
            "resources": ["kopfpeerings"],
            "verbs": ["get", "list", "watch", "patch"],
        } in role["rules"]


def test_more_than_one_replica_needs_leader_election(h):
    """Without leader election every replica would reconcile every model: one at most, and
    Recreate (the old pod goes before the new one starts)."""
    off = "leaderElection.enabled=false"
    err = h.template_error(OPERATOR_CHART, set_=[off])  # the default is 2 replicas
    assert "replicaCount above 1 needs leaderElection.enabled" in err
    docs = h.template(OPERATOR_CHART, set_=[off, "replicaCount=1"])
    deploy, c = _container(docs)
    assert deploy["spec"]["strategy"] == {"type": "Recreate"}
    assert not any(a.startswith("--leader-elect") for a in c["args"])
    assert "sluice.dev/leader-election" not in deploy["spec"]["template"]["metadata"]["annotations"]
    assert [r["metadata"]["name"] for r in by_kind(docs, "Role")] == [
        "sluice-sluice-operator-activator"]  # fmt: skip
    assert not [p for p in by_kind(docs, "PodDisruptionBudget") if p not in activator_docs(docs)]
    deploy, _ = _container(h.template(OPERATOR_CHART, set_=["replicaCount=0"]))
    assert deploy["spec"]["replicas"] == 0  # stopping the operator is fine
    deploy, _ = _container(h.template(OPERATOR_CHART, set_=["replicaCount=3"]))
    assert deploy["spec"]["replicas"] == 3


def test_replicas_spread_over_nodes_and_a_pdb_keeps_one(h):
    selector = one(h.template(OPERATOR_CHART), "Deployment")["spec"]["selector"]["matchLabels"]
    deploy, _ = _container(h.template(OPERATOR_CHART))
    (soft,) = deploy["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    assert soft["podAffinityTerm"] == {
        "topologyKey": "kubernetes.io/hostname",
        "labelSelector": {"matchLabels": selector},
    }
    deploy, _ = _container(h.template(OPERATOR_CHART, set_=["podAntiAffinity=hard"]))
    (hard,) = deploy["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert hard["labelSelector"] == {"matchLabels": selector}
    deploy, _ = _container(h.template(OPERATOR_CHART, set_=["podAntiAffinity="]))
    assert "affinity" not in deploy["spec"]["template"]["spec"]
    pdb = one(h.template(OPERATOR_CHART), "PodDisruptionBudget")
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": selector}}
    for set_ in (["replicaCount=1"], ["podDisruptionBudget.enabled=false"]):
        docs = h.template(OPERATOR_CHART, set_=set_)
        assert by_kind(docs, "PodDisruptionBudget") == by_kind(activator_docs(docs),
                                                               "PodDisruptionBudget")  # fmt: skip
    assert "/podAntiAffinity" in h.template_error(OPERATOR_CHART, set_=["podAntiAffinity=always"])


def test_values_schema_rejects_typos_and_bad_types(h):
    assert "additional properties 'replicas' not allowed" in h.template_error(
        OPERATOR_CHART, set_=["replicas=2"]
    )
    assert "pullPolicy" in h.template_error(OPERATOR_CHART, set_=["image.pullPolicy=Sometimes"])
    assert "serviceAccount.name is required" in h.template_error(
        OPERATOR_CHART, set_=["serviceAccount.create=false"]
    )


# ---- RBAC --------------------------------------------------------------------------------


def _operator_role(docs, kind="ClusterRole"):
    (role,) = [
        d
        for d in by_kind(docs, kind)
        if not d["metadata"]["name"].endswith(("-edit", "-view", "-election", "-activator"))
    ]
    return role


def _side_role(docs, suffix: str) -> dict:
    """The Role in the release namespace for leader election (-election) or the activator."""
    (role,) = [r for r in by_kind(docs, "Role") if r["metadata"]["name"].endswith(suffix)]
    return role


def _grants(rules) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for r in rules:
        for g in r["apiGroups"]:
            for res in r["resources"]:
                out.setdefault((g, res), set()).update(r["verbs"])
    return out


# Exactly what the operator calls (operator/README.md); nothing more.
EXPECTED = {
    ("serving.sluice.dev", "streamingmodels"): {"get", "list", "watch", "patch"},
    ("serving.sluice.dev", "streamingmodels/status"): {"get", "patch"},
    ("serving.sluice.dev", "streamingmodels/finalizers"): {"update"},
    ("apps", "deployments"): {"get", "list", "watch", "create", "patch", "delete"},
    ("apps", "deployments/scale"): {"patch"},
    ("", "services"): {"get", "list", "watch", "create", "patch", "delete"},
    ("", "configmaps"): {"get", "list", "watch", "create", "patch", "delete"},
    ("networking.k8s.io", "ingresses"): {"get", "list", "watch", "create", "patch", "delete"},
    ("autoscaling", "horizontalpodautoscalers"): {
        "get",
        "list",
        "watch",
        "create",
        "patch",
        "delete",
    },
    ("policy", "poddisruptionbudgets"): {"get", "list", "watch", "create", "patch", "delete"},
    ("gateway.networking.k8s.io", "httproutes"): {"get", "create", "patch", "delete"},
    ("inference.networking.k8s.io", "inferencepools"): {"get", "create", "patch", "delete"},
    ("leaderworkerset.x-k8s.io", "leaderworkersets"): {"get", "create", "patch", "delete"},
    ("leaderworkerset.x-k8s.io", "leaderworkersets/scale"): {"patch"},
    ("networking.k8s.io", "networkpolicies"): {
        "get",
        "list",
        "watch",
        "create",
        "patch",
        "delete",
    },
    ("", "pods"): {"list", "watch"},
    ("", "events"): {"create"},
    # Router models' continuation keys: written, never read.
    ("", "secrets"): {"create", "patch", "delete"},
    # The weights cache: shared download Jobs (deleted when a finished one lost its
    # result) and the claim (never deleted: shared).
    ("batch", "jobs"): {"get", "create", "patch", "delete"},
    ("", "persistentvolumeclaims"): {"get", "create", "patch"},
}


def test_rbac_cluster_wide_is_exactly_what_the_operator_uses(h):
    docs = h.template(OPERATOR_CHART)
    role = _operator_role(docs)
    assert _grants(role["rules"]) == EXPECTED
    binding = one(docs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "sluice-sluice-operator", "namespace": "sluice-system"}
    ]
    # Beside it only the leader election's and the activator's Roles, in the release namespace.
    lease_role, activator = _side_role(docs, "-election"), _side_role(docs, "-activator")
    assert len(by_kind(docs, "Role")) == 2
    assert lease_role["metadata"]["namespace"] == activator["metadata"]["namespace"] == (
        "sluice-system")  # fmt: skip
    assert {r["resources"][0] for r in lease_role["rules"]} == {"leases"}
    assert activator["rules"] == [
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create"]},
        {"apiGroups": [""], "resources": ["configmaps"],
         "resourceNames": ["sluice-activator-models"], "verbs": ["get", "patch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
    ]  # fmt: skip
    off = h.template(OPERATOR_CHART, set_=["activator.enabled=false"])
    assert not [r for r in by_kind(off, "Role") if r["metadata"]["name"].endswith("-activator")]


def test_rbac_has_no_wildcards_and_reads_no_secrets(h):
    """No role may read a Secret: the operator's one rule on them writes its router models'
    continuation keys (create, patch, delete), which it never reads back."""
    writes = 0
    for set_ in ([], NAMESPACED):
        docs = h.template(OPERATOR_CHART, values=[ALL_ON], set_=set_)
        for role in by_kind(docs, "ClusterRole") + by_kind(docs, "Role"):
            for rule in role["rules"]:
                assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
                if "secrets" in rule["resources"]:
                    assert rule["resources"] == ["secrets"] and "resourceNames" not in rule
                    assert sorted(rule["verbs"]) == ["create", "delete", "patch"], rule
                    writes += 1
                if not role["metadata"]["name"].endswith("-edit"):
                    assert "escalate" not in rule["verbs"] and "bind" not in rule["verbs"]
    assert writes == 1 + 2  # cluster-wide; a Role in each of the two watched namespaces


RBAC_TPL = OPERATOR_CHART / "templates" / "_rbac-rules.tpl"


def test_rbac_rules_are_commented():
    """Every rule says why (the comment above it is its row in docs/helm.md's table); the
    generator refuses a rule without one."""
    rules = chartdocs.parse_rbac_rules(RBAC_TPL.read_text())
    assert len(rules) >= 10 and all(r.why for r in rules)
    text = RBAC_TPL.read_text()
    why = "# Status (phase, conditions, URLs) is written through the status subresource.\n"
    assert why in text
    with pytest.raises(ValueError, match="rule without a comment"):
        chartdocs.parse_rbac_rules(text.replace(why, ""))


# The values each rule's `if` reads, all off, all on cluster-wide, all on per namespace.
RBAC_SWITCHES = ["keda.enabled", "podMonitors.enabled", "peering.enabled"]
RBAC_CASES = {
    "defaults": ([], {}),
    "all-on": ([f"{k}=true" for k in RBAC_SWITCHES], {k: True for k in RBAC_SWITCHES}),
    "all-on-namespaced": (
        [f"{k}=true" for k in RBAC_SWITCHES] + ["watch.allNamespaces=false"],
        {**{k: True for k in RBAC_SWITCHES}, "watch.allNamespaces": False},
    ),
}


def _granted(rules, values: dict) -> list[dict]:
    """The rules the table says are granted with these values (values.yaml's defaults for the
    rest), in the chart's shape."""
    defaults = yaml.safe_load((OPERATOR_CHART / "values.yaml").read_text())

    def value(key: str) -> bool:
        if key in values:
            return values[key]
        node = defaults
        for part in key.split("."):
            node = node[part]
        return bool(node)

    def on(cond: str) -> bool:
        return not value(cond[4:]) if cond.startswith("not ") else value(cond)

    return [
        {"apiGroups": list(r.api_groups), "resources": list(r.resources), "verbs": list(r.verbs)}
        for r in rules
        if all(on(c) for c in r.when)
    ]


@pytest.mark.parametrize("case", RBAC_CASES, ids=str)
def test_rbac_table_is_what_the_chart_renders(h, case):
    """docs/helm.md's RBAC table (read from _rbac-rules.tpl, conditions and all) lists exactly
    the rules helm renders, in order, for each combination of the values that switch them."""
    set_, values = RBAC_CASES[case]
    rules = [r for r in chartdocs.parse_rbac_rules(RBAC_TPL.read_text())
             if r.define not in (ELECTION, ACTIVATOR)]  # fmt: skip
    kind = "Role" if values.get("watch.allNamespaces") is False else "ClusterRole"
    rendered = _operator_role(h.template(OPERATOR_CHART, set_=set_), kind)["rules"]
    assert _granted(rules, values) == rendered
    # Negative control: a table that missed a rule's condition differs from the chart.
    if case == "defaults":
        text = RBAC_TPL.read_text().replace("{{- if .Values.keda.enabled }}", "", 1)
        text = text.replace("{{- end }}", "", 1)
        assert _granted(chartdocs.parse_rbac_rules(text), values) != rendered


ELECTION = "sluice-operator.rules.election"
ACTIVATOR = "sluice-operator.rules.activator"


def test_rbac_table_lists_the_election_role(h):
    """The leader election's rules (their own Role in the release namespace) are in the table
    as the chart renders them, the Lease's name included; and not rendered when it is off."""
    rules = [r for r in chartdocs.parse_rbac_rules(RBAC_TPL.read_text()) if r.define == ELECTION]
    assert rules and all(r.when == ("leaderElection.enabled",) for r in rules)
    docs = h.template(OPERATOR_CHART)
    (role,) = [r for r in by_kind(docs, "Role") if r["metadata"]["name"].endswith("-election")]
    rendered = [
        (
            tuple(r["apiGroups"]),
            tuple(r["resources"]),
            tuple(r["verbs"]),
            bool(r.get("resourceNames")),
        )
        for r in role["rules"]
    ]
    assert rendered == [(r.api_groups, r.resources, r.verbs, bool(r.resource_names)) for r in rules]
    off = h.template(OPERATOR_CHART, set_=["leaderElection.enabled=false", "replicaCount=1"])
    assert not [r for r in by_kind(off, "Role") if r["metadata"]["name"].endswith("-election")]


def test_rbac_namespaced_mode(h):
    docs = h.template(OPERATOR_CHART, set_=NAMESPACED)
    roles = [r for r in by_kind(docs, "Role")
             if not r["metadata"]["name"].endswith(("-election", "-activator"))]  # fmt: skip
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    for role in roles:
        assert _grants(role["rules"]) == EXPECTED
    bindings = [
        b
        for b in by_kind(docs, "RoleBinding")
        if not b["metadata"]["name"].endswith(("-election", "-activator"))
    ]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    for b in bindings:
        assert b["subjects"][0]["namespace"] == "sluice-system"
    # Only the aggregated user-facing roles remain cluster-scoped.
    assert all(
        r["metadata"]["name"].endswith(("-edit", "-view")) for r in by_kind(docs, "ClusterRole")
    )
    assert not by_kind(docs, "ClusterRoleBinding")
    _, c = _container(docs)
    assert c["args"][:2] == ["--namespace=team-a", "--namespace=team-b"]
    # An empty list means the release namespace.
    docs = h.template(OPERATOR_CHART, set_=["watch.allNamespaces=false"], namespace="models")
    roles = by_kind(_not_router(docs), "Role")
    assert [r["metadata"]["namespace"] for r in roles] == ["models"] * 3


def test_keda_set_and_not_rendered(h):
    assert ("keda.sh", "scaledobjects") not in _grants(
        _operator_role(h.template(OPERATOR_CHART))["rules"]
    )
    # So is the Prometheus Operator's PodMonitor with podMonitors.enabled.
    grants = _grants(
        _operator_role(
            h.template(OPERATOR_CHART, set_=["keda.enabled=true", "podMonitors.enabled=true"])
        )["rules"]
    )
    # Exactly what the operator calls (not watched: KEDA's CRD may be absent).
    assert grants[("keda.sh", "scaledobjects")] == {"get", "create", "patch", "delete"}


def test_aggregated_user_roles_set_and_not_rendered(h):
    docs = h.template(OPERATOR_CHART)
    edit = [d for d in by_kind(docs, "ClusterRole") if d["metadata"]["name"].endswith("-edit")][0]
    view = [d for d in by_kind(docs, "ClusterRole") if d["metadata"]["name"].endswith("-view")][0]
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert {"create", "delete"} <= _grants(edit["rules"])[("serving.sluice.dev", "streamingmodels")]
    assert _grants(view["rules"])[("serving.sluice.dev", "streamingmodels")] == {
        "get",
        "list",
        "watch",
    }
    docs = h.template(OPERATOR_CHART, set_=["rbac.aggregateToDefaultRoles=false"])
    assert len(by_kind(_not_router(docs), "ClusterRole")) == 1
    docs = h.template(OPERATOR_CHART, set_=["rbac.create=false"])
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ClusterRoleBinding")


def _needed(children, watched, streaming_model) -> dict[tuple[str, str], set[str]]:
    """(apiGroup, resource) -> verbs the operator's calls need, from its table of kinds:
    children are read and server-side applied (a patch that creates is authorized as create),
    optional ones also deleted; watched kinds are listed and watched; kopf lists, watches and
    annotates the StreamingModel, and its status is patched through the subresource."""
    need: dict[tuple[str, str], set[str]] = {}
    for k in children:
        verbs = {"get", "create", "patch"} | ({"delete"} if k.optional else set())
        need.setdefault((k.group, k.plural), set()).update(verbs)
    for k in watched:
        need.setdefault((k.group, k.plural), set()).update({"list", "watch"})
    sm = streaming_model
    need.setdefault((sm.group, sm.plural), set()).update({"get", "list", "watch", "patch"})
    need.setdefault((sm.group, f"{sm.plural}/status"), set()).update({"get", "patch"})
    return need


def _missing(need, grants) -> dict[tuple[str, str], set[str]]:
    return {
        key: verbs - grants.get(key, set())
        for key, verbs in need.items()
        if verbs - grants.get(key, set())
    }


def test_rbac_covers_every_child_the_operator_manages(h):
    """Every kind in the operator's one table (`sluice_operator.kinds`) is granted what the
    operator does with it, so a kind added there without a chart rule fails here; children
    the operator never deletes are not granted delete; and the samples render only kinds
    from the table."""
    kinds = pytest.importorskip("sluice_operator.kinds")
    render = pytest.importorskip("sluice_operator.render")
    # KEDA's ScaledObject (autoscaling.backend: keda) is only granted with keda.enabled.
    # So is the Prometheus Operator's PodMonitor with podMonitors.enabled.
    grants = _grants(
        _operator_role(
            h.template(OPERATOR_CHART, set_=["keda.enabled=true", "podMonitors.enabled=true"])
        )["rules"]
    )
    # The weights cache's Jobs and claims (not children: shared), read and created like them.
    need = _needed(
        (*kinds.ALL_KINDS, *kinds.WEIGHTS_KINDS), kinds.WATCHED_KINDS, kinds.STREAMING_MODEL
    )
    # Children written but never read (router models' continuation keys): apply and delete.
    for k in kinds.WRITE_ONLY_KINDS:
        need.setdefault((k.group, k.plural), set()).update({"create", "patch", "delete"})
        assert k not in kinds.WATCHED_KINDS and k not in kinds.ALL_KINDS
    missing = _missing(need, grants)
    claims = ("", "persistentvolumeclaims")
    assert "delete" not in grants[claims], "the weights claim is never deleted (shared)"
    assert not missing, f"add to charts/sluice-operator/templates/_rbac-rules.tpl: {missing}"
    deleted = {(k.group, k.plural) for k in kinds.ALL_KINDS if k.optional}
    for k in kinds.ALL_KINDS:  # (an optional kind may share the resource: the activator's)
        if not k.optional and (k.group, k.plural) not in deleted:
            assert "delete" not in grants[(k.group, k.plural)], f"{k.kind} is never deleted"
    # Negative control: a kind added to the table without a rule is reported.
    widget = kinds.Kind("example.com/v1", "Widget", "widgets", optional=True)
    need = _needed((*kinds.ALL_KINDS, widget), kinds.WATCHED_KINDS, kinds.STREAMING_MODEL)
    assert _missing(need, grants) == {
        ("example.com", "widgets"): {"get", "create", "patch", "delete"}
    }
    managed = {k.kind for k in (*kinds.ALL_KINDS, *kinds.WRITE_ONLY_KINDS)}
    rendered = set()
    key = pytest.importorskip("sluice_operator.models.resource").OperatorDefaults(
        continuation_key=b"k"
    )
    for sample in sorted((ROOT / "samples").glob("*.yaml")):
        docs = render.render_file(sample, namespace=None, defaults=key)
        for doc in yaml.safe_load_all(docs):
            if doc:
                rendered.add(doc["kind"])
    assert {"Deployment", "Service", "Secret"} <= rendered <= managed


def _lease_calls() -> list[tuple[str, str]]:
    """(HTTP method, last path segment) of every request the operator's Lease store can send:
    each of its operations run once against a recorder (a 404 first, so create is reached)."""
    import asyncio

    cluster_mod = pytest.importorskip("sluice_operator.cluster")
    election = pytest.importorskip("sluice_operator.election")
    from kubernetes.client.exceptions import ApiException

    sent = []
    lease = {"metadata": {"resourceVersion": "1"}, "spec": {"holderIdentity": "a"}}
    answers = [ApiException(status=404), lease, lease]

    class Recorder:
        def _call(self, method, path, **_):
            sent.append((method, path.rsplit("/", 1)[-1]))
            answer = answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer

    leases = cluster_mod.KubeLeases(Recorder(), "sluice-system", "sluice-sluice-operator", 10)

    async def every_operation():
        await leases.get()
        record = await leases.create(election.LeaseRecord("a"))
        await leases.update(record)

    asyncio.run(every_operation())
    return sent


def test_rbac_grants_exactly_the_lease_calls_the_operator_makes(h):
    """The Role lets the operator do what `cluster.KubeLeases` sends (GET and PUT of its own
    Lease, POST to create it) and nothing else; the Lease it names is the one the rendered
    arguments name."""
    verbs_of = {"GET": "get", "PUT": "update", "POST": "create", "PATCH": "patch"}
    need: dict[str | None, set[str]] = {}
    for method, last in _lease_calls():
        on_collection = last == "leases"  # a create names no object: RBAC sees no name
        need.setdefault(None if on_collection else last, set()).add(verbs_of[method])
    docs = h.template(OPERATOR_CHART)
    role = _side_role(docs, "-election")
    granted: dict[str | None, set[str]] = {}
    for rule in role["rules"]:
        assert rule["apiGroups"] == ["coordination.k8s.io"] and rule["resources"] == ["leases"]
        for name in rule.get("resourceNames") or [None]:
            granted.setdefault(name, set()).update(rule["verbs"])
    assert granted == need == {None: {"create"}, "sluice-sluice-operator": {"get", "update"}}
    _, c = _container(docs)
    assert "--leader-elect-resource-name=sluice-sluice-operator" in c["args"]
    assert f"--leader-elect-resource-namespace={role['metadata']['namespace']}" in c["args"]
    binding = [
        b for b in by_kind(docs, "RoleBinding") if b["roleRef"]["name"] == role["metadata"]["name"]
    ]
    assert binding[0]["subjects"][0]["name"] == "sluice-sluice-operator"
    docs = h.template(OPERATOR_CHART, set_=["leaderElection.enabled=false", "replicaCount=1"])
    assert "coordination.k8s.io" not in yaml.safe_dump(docs)


# ---- names -------------------------------------------------------------------------------


def test_names_are_truncated_to_63_characters(h):
    long = "a-very-long-release-name-that-goes-on-and-on-and-on-for-ever-and-ever"
    docs = h.template(
        OPERATOR_CHART, release=long[:53], set_=["prometheusAdapter.rules.enabled=true"]
    )
    for doc in docs:
        assert len(doc["metadata"]["name"]) <= 63, doc["metadata"]["name"]
        assert not doc["metadata"]["name"].endswith("-")
        for v in doc["metadata"]["labels"].values():
            assert len(v) <= 63
    docs = h.template(OPERATOR_CHART, set_=[f"fullnameOverride={long[:63]}"])
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert all(len(n) <= 63 for _, n in names)
    assert len(names) == len(docs)  # truncation never makes two objects of a kind collide


def test_release_name_containing_chart_name_is_not_doubled(h):
    docs = h.template(OPERATOR_CHART, release="sluice-operator")
    assert one(docs, "Deployment")["metadata"]["name"] == "sluice-operator"


# ---- values documentation ----------------------------------------------------------------


def test_every_value_is_documented():
    documented, undocumented = documented_keys(OPERATOR_CHART / "values.yaml")
    assert not undocumented, f"values without a `# --` comment: {undocumented}"
    assert len(documented) > 30


def test_documented_keys_notices_a_missing_comment(tmp_path):
    """Negative control for the check above."""
    f = tmp_path / "values.yaml"
    f.write_text("# -- documented\na: 1\nsection:\n  # -- fine\n  b: 2\n  c: 3\nd: 4\n")
    documented, undocumented = documented_keys(f)
    assert documented == ["a", "section.b"]
    assert undocumented == ["section.c", "d"]


def test_values_table_rows_from_comments():
    """The generator's reading of a values.yaml: file order, the `# --` block from its marker
    on, types from the default or `(type)`, a documented section's keys as its content, JSON
    defaults, and cells a Markdown renderer keeps."""
    text = (
        "# file header, not a description\n\n"
        "# a note above the marker\n# -- The name (`<release>`, or <other>).\n# Two lines.\n"
        'name: ""\n'
        "section:\n  # -- A port.\n  port: 8080\n  # -- On | off.\n  enabled: true\n"
        "# -- (int) Replicas; null for the default.\nreplicas: null\n"
        "# -- Probe timing.\nprobe:\n  periodSeconds: 5\n  list:\n    - a\n"
    )
    rows, undocumented = chartdocs.parse_values(text)
    assert undocumented == []
    assert [(r.key, r.type, r.default) for r in rows] == [
        ("name", "string", ""),
        ("section.port", "int", 8080),
        ("section.enabled", "bool", True),
        ("replicas", "int", None),
        ("probe", "object", {"periodSeconds": 5, "list": ["a"]}),
    ]
    assert rows[0].description == "The name (`<release>`, or <other>). Two lines."
    table = chartdocs.values_table(text, Path("values.yaml")).splitlines()
    assert (
        table[2] == '| `name` | string | `""` | The name (`<release>`, or &lt;other>). Two lines. |'
    )
    assert table[4] == "| `section.enabled` | bool | `true` | On \\| off. |"
    assert table[6] == '| `probe` | object | `{"periodSeconds":5,"list":["a"]}` | Probe timing. |'
    with pytest.raises(ValueError, match="without a `# --` comment: section.port"):
        chartdocs.values_table(text.replace("# -- A port.", "# A port."), Path("values.yaml"))


@pytest.mark.parametrize("chart", [OPERATOR_CHART, MODEL_CHART], ids=lambda c: c.name)
def test_docs_values_table_is_values_yaml(chart):
    """docs/helm.md's generated table for the chart has one row per documented value, with
    values.yaml's default (the staleness test in tests/operator checks the whole text)."""
    name = "operator-values" if chart == OPERATOR_CHART else "model-values"
    doc = (ROOT / "docs" / "helm.md").read_text()
    section = doc.split(f"<!-- generated:{name} -->")[1].split(f"<!-- end:{name} -->")[0]
    values = yaml.safe_load((chart / "values.yaml").read_text())
    documented, _ = documented_keys(chart / "values.yaml")
    rows = {}
    for line in section.strip().splitlines()[2:]:
        key, _type, default, _ = (c.strip() for c in line.strip().strip("|").split(" | ", 3))
        rows[key.strip("`")] = json.loads(default.strip("`"))
    assert list(rows) == documented
    for key, default in rows.items():
        node = values
        for part in key.split("."):
            node = node[part]
        assert default == node, key


def test_rbac_lets_kopf_watch_everything_the_operator_handles(h):
    """Every resource the operator's kopf handlers watch needs list and watch (kopf lists,
    then watches); the StreamingModel also patch (kopf's annotations). Read from kopf's
    registry after importing the real handlers, so a new watch without RBAC fails here."""
    kopf = pytest.importorskip("kopf")
    pytest.importorskip("sluice_operator.handlers")
    registry = kopf.get_default_registry()
    crd = yaml.safe_load(CRD_FILE.read_text())
    handlers = [
        *registry._watching.get_all_handlers(),
        *registry._changing.get_all_handlers(),
        *registry._spawning.get_all_handlers(),
    ]
    assert handlers
    grants = _grants(_operator_role(h.template(OPERATOR_CHART))["rules"])
    for handler in handlers:
        sel = handler.selector
        group = sel.group or ""
        plural = sel.plural or (
            crd["spec"]["names"]["plural"] if group == crd["spec"]["group"] else None
        )
        assert plural, f"cannot tell the resource of handler {handler.id}"
        assert {"list", "watch"} <= grants.get((group, plural), set()), (group, plural, handler.id)
    assert "patch" in grants[(crd["spec"]["group"], crd["spec"]["names"]["plural"])]


# ---- packaging ---------------------------------------------------------------------------


@pytest.mark.parametrize("chart", [OPERATOR_CHART, MODEL_CHART], ids=lambda c: c.name)
def test_package_holds_only_the_chart(h, tmp_path, chart):
    h.run("package", str(chart), "--destination", str(tmp_path))
    (tgz,) = tmp_path.glob("*.tgz")
    with tarfile.open(tgz) as tar:
        names = tar.getnames()
    assert f"{chart.name}/values.schema.json" in names and f"{chart.name}/README.md" in names
    assert not [n for n in names if "__pycache__" in n or n.endswith((".pyc", ".orig", "~"))]
    if chart == OPERATOR_CHART:
        assert f"{chart.name}/crds/{CRD_FILE.name}" in names
        assert f"{chart.name}/files/prometheus-adapter-rules.yaml" in names


@pytest.mark.parametrize("chart", [OPERATOR_CHART, MODEL_CHART], ids=lambda c: c.name)
def test_kube_version_floor(h, chart):
    ok = h.run("template", "sluice", str(chart), "--kube-version", "1.30.0", check=False)
    assert ok.returncode == 0, ok.stderr
    old = h.run("template", "sluice", str(chart), "--kube-version", "1.29.9", check=False)
    assert old.returncode != 0 and "kubeVersion" in old.stderr


# ---- network policy ------------------------------------------------


def test_network_policy_set_and_not_rendered(h):
    docs = h.template(OPERATOR_CHART)
    assert by_kind(docs, "NetworkPolicy") == by_kind(activator_docs(docs), "NetworkPolicy")
    docs = h.template(OPERATOR_CHART, set_=["networkPolicy.enabled=true"])
    policy = one(docs, "NetworkPolicy")
    deploy = one(docs, "Deployment")
    assert policy["spec"]["podSelector"]["matchLabels"] == deploy["spec"]["selector"]["matchLabels"]
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert policy["spec"]["ingress"] == [
        {"ports": [{"port": 8080, "protocol": "TCP"}, {"port": 8081, "protocol": "TCP"}]}
    ]
    dns, api, pods, weights, activator = policy["spec"]["egress"]
    assert {p["port"] for p in dns["ports"]} == {53}
    assert [p["port"] for p in api["ports"]] == [443, 6443] and "to" not in api
    # The model pods' /metrics (status.adapters), only pods the operator manages.
    assert pods["ports"] == [{"port": 8000, "protocol": "TCP"}]
    assert pods["to"] == [{"namespaceSelector": {}, "podSelector": {"matchLabels": {
        "app.kubernetes.io/managed-by": "sluice-operator"}}}]  # fmt: skip
    # The weights downloads' /progress (status WeightsReady), only the download pods.
    assert weights["ports"] == [{"port": 8090, "protocol": "TCP"}]
    assert weights["to"] == [{"namespaceSelector": {}, "podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "sluice-weights",
        "app.kubernetes.io/component": "weights-download"}}}]  # fmt: skip
    # The activator pods' /metrics in the release namespace (held requests: scale to zero).
    assert activator["ports"] == [{"port": 8000, "protocol": "TCP"}]
    assert activator["to"] == [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "sluice-activator", "app.kubernetes.io/instance": "sluice",
        "app.kubernetes.io/component": "activator"}}}]  # fmt: skip
    docs = h.template(OPERATOR_CHART, values=[ALL_ON])
    (_, api, *_) = one(docs, "NetworkPolicy")["spec"]["egress"]
    assert api["to"] == [{"ipBlock": {"cidr": "10.0.0.1/32"}}]
    docs = h.template(OPERATOR_CHART, set_=["networkPolicy.enabled=true",
                                            "networkPolicy.modelPodMetrics=false"])  # fmt: skip
    assert len(one(docs, "NetworkPolicy")["spec"]["egress"]) == 4
    docs = h.template(
        OPERATOR_CHART, set_=["networkPolicy.enabled=true", "activator.enabled=false"]
    )
    assert len(one(docs, "NetworkPolicy")["spec"]["egress"]) == 4


@pytest.mark.parametrize(
    "chart,values,set_",
    [
        (OPERATOR_CHART, [], []),
        (OPERATOR_CHART, [ALL_ON], NAMESPACED),
        (MODEL_CHART, [], []),
        (MODEL_CHART, [HERE / "streaming-model-values-all-on.yaml"], []),
    ],
    ids=["operator", "operator-all-on-namespaced", "model", "model-all-on"],
)
def test_install_notes_render(h, chart, values, set_):
    """`helm install` (client-side dry run) renders NOTES.txt, which `helm template` skips."""
    args = ["install", "sluice", str(chart), "-n", "team-a", "--dry-run=client"]
    for v in values:
        args += ["-f", str(v)]
    for s in set_:
        args += ["--set", s]
    out = h.run(*args).stdout
    notes = out.split("NOTES:", 1)[1]
    assert "kubectl" in notes and "<no value>" not in notes
    if set_:
        assert "team-a, team-b" in notes


def test_common_labels_and_image_tag(h):
    docs = h.template(OPERATOR_CHART, values=[ALL_ON])
    for doc in docs:
        assert doc["metadata"]["labels"]["team"] == "platform", doc["kind"]
    docs = h.template(OPERATOR_CHART, set_=["image.tag=1.2.3"])
    _, c = _container(docs)
    assert c["image"] == "ghcr.io/sluice-dev/sluice-operator:1.2.3"
    assert one(docs, "Deployment")["metadata"]["labels"]["app.kubernetes.io/version"] == "1.2.3"
    # selector labels never carry the version: upgrades must not orphan the old pods
    selector = one(docs, "Deployment")["spec"]["selector"]["matchLabels"]
    assert "app.kubernetes.io/version" not in selector and "helm.sh/chart" not in selector


# ---- the activator (scale to zero) ---------------------------------------------------


def test_activator_set_and_not_rendered(h):
    """Two replicas of the server image in activator mode, a PDB that keeps one, no API
    token, the operator's models ConfigMap mounted whole (optional: the operator writes it),
    probes on its own routes; the operator is told where it is. Off: none of it, and the
    operator runs without --activator-* (no model is scaled to zero)."""
    docs = h.template(OPERATOR_CHART)
    act = activator_docs(docs)
    (deploy,) = by_kind(act, "Deployment")
    (svc,) = by_kind(act, "Service")
    (pdb,) = by_kind(act, "PodDisruptionBudget")
    (policy,) = by_kind(act, "NetworkPolicy")
    assert deploy["metadata"]["name"] == svc["metadata"]["name"] == "sluice-activator"
    pod = deploy["spec"]["template"]["spec"]
    selector = deploy["spec"]["selector"]["matchLabels"]
    assert deploy["spec"]["replicas"] == 2
    assert pdb["spec"] == {"minAvailable": 1, "selector": {"matchLabels": selector}}
    assert svc["spec"]["selector"] == selector == policy["spec"]["podSelector"]["matchLabels"]
    assert svc["spec"]["ports"][0]["port"] == 8000
    # Its own token (the router watches model Pods), never the operator's.
    assert pod["automountServiceAccountToken"] is True
    assert pod["serviceAccountName"] == "sluice-activator"
    (c,) = pod["containers"]
    assert c["image"] == "ghcr.io/sluice-dev/sluice-server:0.1.0"
    assert c["command"] == ["sluice-server", "activator"]
    assert c["args"] == ["--models-file=/etc/sluice/activator/models.json"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["SLUICE_ACTIVATOR_PIN_KEY_FILE"] == "/etc/sluice/pin/pin-key"
    assert env["SLUICE_ACTIVATOR_CONTINUATION_KEY_FILE"] == "/etc/sluice/continuation/master"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    (models,) = [v for v in pod["volumes"] if v["name"] == "models"]
    assert models["configMap"] == {"name": "sluice-activator-models", "optional": True}
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "models"]
    assert "subPath" not in mount and mount["mountPath"] == "/etc/sluice/activator"
    # Ingress on 8000 from anywhere; egress to DNS and the model pods' port only.
    assert policy["spec"]["ingress"] == [{"ports": [{"port": 8000, "protocol": "TCP"}]}]
    dns, api, models_egress = policy["spec"]["egress"]
    assert {p["port"] for p in dns["ports"]} == {53}
    assert {p["port"] for p in api["ports"]} == {443, 6443} and "to" not in api
    assert {p["port"] for p in models_egress["ports"]} == {8000, 5557, 5558}
    assert models_egress["to"][0]["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/managed-by": "sluice-operator",
        "app.kubernetes.io/component": "model-server",
    }
    _, op = _container(docs)
    assert "--activator-service=sluice-activator" in op["args"]
    # The operator's selector finds exactly the activator's pods.
    (flag,) = [a for a in op["args"] if a.startswith("--activator-selector=")]
    want = dict(kv.split("=") for kv in flag.split("=", 1)[1].split(","))
    assert want.items() <= deploy["spec"]["template"]["metadata"]["labels"].items()
    off = h.template(OPERATOR_CHART, set_=["activator.enabled=false"])
    assert not activator_docs(off)
    _, op = _container(off)
    assert not any(a.startswith(("--activator", "--continuation")) for a in op["args"])
    docs = h.template(OPERATOR_CHART, set_=["activator.networkPolicy=false"])
    assert not by_kind(activator_docs(docs), "NetworkPolicy")


def _not_router(docs):
    """All but the router's RBAC (test_router_rbac_pin_key_and_token_set_and_not_rendered)."""
    router = _router_docs(docs)
    return [d for d in docs if d not in router]


def _router_docs(docs):
    return [d for d in docs if d["metadata"]["name"].startswith("sluice-activator")
            and d["kind"] in ("ServiceAccount", "Secret", "ClusterRole", "ClusterRoleBinding",
                              "Role", "RoleBinding")]  # fmt: skip


def test_router_rbac_pin_key_and_token_set_and_not_rendered(h):
    """The router's own ServiceAccount, get/list/watch on Pods scoped as the operator's RBAC
    (a ClusterRole, or a Role per watched namespace), its pin-key Secret mounted read-only;
    the activator off: none of it."""
    docs = h.template(OPERATOR_CHART)
    router = _router_docs(docs)
    (sa,) = by_kind(router, "ServiceAccount")
    (role,) = by_kind(router, "ClusterRole")
    (binding,) = by_kind(router, "ClusterRoleBinding")
    (secret,) = [d for d in by_kind(router, "Secret") if d["metadata"]["name"].endswith("-pin-key")]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "sluice-system"}
    ]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert len(base64.b64decode(secret["data"]["pin-key"])) == 48
    (deploy,) = by_kind(activator_docs(docs), "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    (vol,) = [v for v in pod["volumes"] if v["name"] == "pin-key"]
    assert vol["secret"]["secretName"] == secret["metadata"]["name"]
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "pin-key"]
    assert mount == {"name": "pin-key", "mountPath": "/etc/sluice/pin", "readOnly": True}
    # Namespaced: a Role and RoleBinding in each watched namespace, no ClusterRole.
    scoped = _router_docs(h.template(OPERATOR_CHART, set_=NAMESPACED))
    assert not by_kind(scoped, "ClusterRole")
    assert sorted(r["metadata"]["namespace"] for r in by_kind(scoped, "Role")) == [
        "team-a", "team-b"]  # fmt: skip
    assert all(r["rules"] == role["rules"] for r in by_kind(scoped, "Role"))
    assert len(by_kind(scoped, "RoleBinding")) == 2
    # rbac.create=false: the ServiceAccount and key stay, no grants.
    bare = _router_docs(h.template(OPERATOR_CHART, set_=["rbac.create=false"]))
    assert {d["kind"] for d in bare} == {"ServiceAccount", "Secret"}
    # The activator off: no router either.
    assert not _router_docs(h.template(OPERATOR_CHART, set_=["activator.enabled=false"]))


def _pin_key_volume(docs) -> dict:
    (deploy,) = by_kind(activator_docs(docs), "Deployment")
    (vol,) = [v for v in deploy["spec"]["template"]["spec"]["volumes"] if v["name"] == "pin-key"]
    return vol["secret"]


def test_router_pin_key_existing_secret_set_and_not_rendered(h):
    """Not set: the chart's own Secret, a new random key on every render without a cluster
    (what `helm template` and Argo CD do). Set: no Secret of the chart's, every router pod
    mounts the named one (its key as the file `pin-key`), and renders are identical."""
    argv = ["template", "sluice", str(OPERATOR_CHART), "--namespace", "sluice-system"]

    def key() -> str:
        docs = [d for d in yaml.safe_load_all(h.run(*argv).stdout) if d]
        (secret,) = [d for d in by_kind(_router_docs(docs), "Secret") if "pin-key" in d["data"]]
        return secret["data"]["pin-key"]

    keys = [key(), key()]
    assert keys[0] != keys[1]  # the problem existingSecret solves
    assert _pin_key_volume(h.template(OPERATOR_CHART))["secretName"] == "sluice-activator-pin-key"
    mine = ["activator.pinKey.existingSecret=router-pin", "activator.pinKey.existingSecretKey=k"]
    docs = h.template(OPERATOR_CHART, set_=mine)
    assert not [d for d in docs if d["kind"] == "Secret" and "pin-key" in d["data"]]
    assert _pin_key_volume(docs) == {
        "secretName": "router-pin",
        "items": [{"key": "k", "path": "pin-key"}],
        "defaultMode": 0o440,
    }
    (deploy,) = by_kind(activator_docs(docs), "Deployment")
    env = {
        e["name"]: e["value"] for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["SLUICE_ACTIVATOR_PIN_KEY_FILE"] == "/etc/sluice/pin/pin-key"
    # With the continuation key's Secret named too, nothing random is left.
    mine += ["activator.continuationKey.existingSecret=router-continuation"]
    sets = [a for s in mine for a in ("--set", s)]
    assert h.run(*argv, *sets).stdout == h.run(*argv, *sets).stdout


def _continuation_volumes(docs) -> list[dict]:
    """The continuation-key volume of the router's pods and of the operator's."""
    (router,) = by_kind(activator_docs(docs), "Deployment")
    operator, _ = _container(docs)
    return [
        v
        for d in (router, operator)
        for v in d["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "continuation-key"
    ]


def test_router_continuation_key_set_and_not_rendered(h):
    """The router's master continuation key: one Secret (48 random characters) mounted
    read-only in the router's pods (their --continuation-key-file, as its env form) and in
    the operator's (its --continuation-key-file), both as the file `master`. A Secret of
    your own: the chart makes none and both mount it. The activator off: no key anywhere
    and the operator runs without the flag (no stream migrates)."""
    docs = h.template(OPERATOR_CHART)
    (secret,) = [d for d in docs if d["metadata"]["name"] == "sluice-activator-continuation-key"]
    assert secret["kind"] == "Secret" and secret["metadata"]["namespace"] == "sluice-system"
    assert len(base64.b64decode(secret["data"]["continuation-key"])) == 48
    volumes = _continuation_volumes(docs)
    assert len(volumes) == 2 and all(v == volumes[0] for v in volumes)
    assert volumes[0]["secret"] == {
        "secretName": "sluice-activator-continuation-key",
        "items": [{"key": "continuation-key", "path": "master"}],
        "defaultMode": 0o440,
    }
    (router,) = by_kind(activator_docs(docs), "Deployment")
    operator, op = _container(docs)
    mount = {"name": "continuation-key", "mountPath": "/etc/sluice/continuation", "readOnly": True}
    for c in (router["spec"]["template"]["spec"]["containers"][0], op):
        assert mount in c["volumeMounts"]
    env = {
        e["name"]: e.get("value")
        for e in router["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["SLUICE_ACTIVATOR_CONTINUATION_KEY_FILE"] == "/etc/sluice/continuation/master"
    assert "--continuation-key-file=/etc/sluice/continuation/master" in op["args"]
    # A Secret of the user's: the chart makes none, both pods mount it.
    mine = ["activator.continuationKey.existingSecret=cont",
            "activator.continuationKey.existingSecretKey=k"]  # fmt: skip
    docs = h.template(OPERATOR_CHART, set_=mine)
    assert not [d for d in docs if d["kind"] == "Secret" and "continuation-key" in d["data"]]
    assert [v["secret"] for v in _continuation_volumes(docs)] == 2 * [
        {"secretName": "cont", "items": [{"key": "k", "path": "master"}], "defaultMode": 0o440}
    ]
    # The activator off: nothing of it.
    off = h.template(OPERATOR_CHART, set_=["activator.enabled=false"])
    assert not [d for d in off if "continuation" in d["metadata"]["name"]]
    operator, op = _container(off)
    assert not [v for v in operator["spec"]["template"]["spec"]["volumes"]
                if v["name"] == "continuation-key"]  # fmt: skip
    assert not [m for m in op["volumeMounts"] if m["name"] == "continuation-key"]
    assert not any(a.startswith("--continuation-key-file") for a in op["args"])


def test_router_pods_stop_after_a_prestop_pause_within_their_grace_period(h):
    """A preStop `sleep` keeps a stopped router pod serving while its endpoint removal
    spreads; the grace period covers it, the drain (passed as the router's env) and the
    5 s forwarded requests get after it. 0: no hook. The drain as an extra argument would
    escape the grace period: refused."""

    def pod(*set_: str) -> tuple[dict, dict]:
        (deploy,) = by_kind(activator_docs(h.template(OPERATOR_CHART, set_=list(set_))),
                            "Deployment")  # fmt: skip
        spec = deploy["spec"]["template"]["spec"]
        return spec, spec["containers"][0]

    spec, c = pod()
    assert c["lifecycle"] == {"preStop": {"sleep": {"seconds": 5}}}
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["SLUICE_ACTIVATOR_DRAIN_TIMEOUT_SECONDS"] == "30"
    assert spec["terminationGracePeriodSeconds"] == 60 >= 5 + 30 + 5
    spec, c = pod("activator.preStopSeconds=0", "activator.drainTimeoutSeconds=120")
    assert "lifecycle" not in c
    assert {e["name"]: e["value"] for e in c["env"]}[
        "SLUICE_ACTIVATOR_DRAIN_TIMEOUT_SECONDS"
    ] == "120"
    assert spec["terminationGracePeriodSeconds"] == 145 >= 0 + 120 + 5
    spec, c = pod("activator.preStopSeconds=15")
    assert c["lifecycle"]["preStop"]["sleep"]["seconds"] == 15
    assert spec["terminationGracePeriodSeconds"] == 70
    err = h.template_error(
        OPERATOR_CHART, set_=["activator.extraArgs={--drain-timeout-seconds=90}"]
    )
    assert "activator.drainTimeoutSeconds" in err


def test_router_pods_carry_the_labels_the_kv_events_policies_admit(h):
    """The operator's NetworkPolicies admit a router model's KV-event ports from pods with
    these labels in the operator's namespace: the chart's router pods must carry them."""
    from sluice_operator.builders.kvevents import ROUTER_POD_LABELS

    (deploy,) = by_kind(activator_docs(h.template(OPERATOR_CHART)), "Deployment")
    assert deploy["metadata"]["namespace"] == "sluice-system"
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert ROUTER_POD_LABELS.items() <= labels.items()
    # Whatever the release is called.
    docs = h.template(OPERATOR_CHART, release="edge")
    (deploy,) = by_kind(activator_docs(docs), "Deployment")
    assert ROUTER_POD_LABELS.items() <= deploy["spec"]["template"]["metadata"]["labels"].items()


def test_activator_names_match_what_the_operator_builds():
    """The ExternalName target and the ConfigMap the operator writes are the chart's."""
    from sluice_operator.builders.activator import desired_models_config_map
    from sluice_operator.models.resource import DEFAULT_ACTIVATOR_HOST
    from sluice_operator.scaletozero_poller import ActivatorSettings

    settings = ActivatorSettings("sluice-activator", "sluice-system", "x=y")
    assert settings.host == DEFAULT_ACTIVATOR_HOST
    cm = desired_models_config_map(settings.service, settings.namespace, [])
    assert cm["metadata"]["name"] == "sluice-activator-models"
    assert cm["data"] == {"models.json": "{}\n"}
