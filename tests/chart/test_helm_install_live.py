"""`helm install` of both charts into a real API server (tests/e2e's control plane).

The API server, not a schema copy, has the last word: every object of the operator chart
(all-on values, namespaced mode) is accepted, the chart's CRD is kept when it already
exists, the streaming-model chart's StreamingModel passes the CRD's schema and CEL rules
(and one that breaks a CEL rule the values schema cannot express is refused with its
message), and `helm uninstall` removes what was installed. Needs K8S_ASSETS and etcd, like
tests/e2e; otherwise skipped with one line.
"""

from __future__ import annotations

import shutil

import pytest
import yaml

from .chartlib import HERE, MODEL_CHART, OPERATOR_CHART

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def charts(live_cluster, tmp_path_factory):
    """The charts as shipped, except: an API server built from source without version
    stamping reports v0.0.0, which no kubeVersion floor accepts, so for such a server the
    floor is dropped (test_kube_version_floor checks it offline)."""
    from kubernetes import client

    _, admin = live_cluster
    version = client.VersionApi(admin).get_code().git_version
    if not version.startswith("v0.0.0"):
        return OPERATOR_CHART, MODEL_CHART
    out = []
    for chart in (OPERATOR_CHART, MODEL_CHART):
        dst = tmp_path_factory.mktemp("charts") / chart.name
        shutil.copytree(chart, dst)
        meta = yaml.safe_load((dst / "Chart.yaml").read_text())
        meta.pop("kubeVersion")
        (dst / "Chart.yaml").write_text(yaml.safe_dump(meta, sort_keys=False))
        out.append(dst)
    return tuple(out)


def _helm(h, cp, *args: str, check: bool = True):
    return h.run(*args, "--kubeconfig", str(cp.kubeconfigs["admin"]), check=check)


def test_operator_chart_installs_and_uninstalls(h, live_cluster, charts):
    from kubernetes import client

    cp, admin = live_cluster
    operator_chart, _ = charts
    core = client.CoreV1Api(admin)
    # team-x/team-y are watched; monitoring is where the adapter rules go (values-all-on.yaml)
    for ns in ("team-x", "team-y", "monitoring"):
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
    out = _helm(
        h, cp, "install", "helmop", str(operator_chart), "-n", "helm-system", "--create-namespace",
        "-f", str(HERE / "values-all-on.yaml"),
        "--set", "watch.allNamespaces=false", "--set", "watch.namespaces={team-x,team-y}",
        "--set", "prometheusRules.enabled=false",  # the PrometheusRule CRD is not installed here
    ).stdout  # fmt: skip
    assert "STATUS: deployed" in out
    manifest = _helm(h, cp, "get", "manifest", "helmop", "-n", "helm-system").stdout
    objects = [d for d in yaml.safe_load_all(manifest) if d]
    assert {
        "Deployment",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "ConfigMap",
        "NetworkPolicy",
    } <= {o["kind"] for o in objects}
    rbac = client.RbacAuthorizationV1Api(admin)
    for ns in ("team-x", "team-y"):
        assert rbac.read_namespaced_role("sluice-operator", ns).rules
    apps = client.AppsV1Api(admin)
    deploy = apps.read_namespaced_deployment("sluice-operator", "helm-system")
    assert (
        deploy.spec.template.spec.containers[0].security_context.read_only_root_filesystem is True
    )
    cm = core.read_namespaced_config_map("sluice-operator-prometheus-adapter-rules", "monitoring")
    assert "sluice_ttft_p90_seconds" in cm.data["config.yaml"]

    out = _helm(h, cp, "uninstall", "helmop", "-n", "helm-system").stdout
    assert "uninstalled" in out
    assert not apps.list_namespaced_deployment("helm-system").items
    for ns in ("team-x", "team-y"):
        assert not rbac.list_namespaced_role(ns).items
    # The CRD stays (Helm never deletes crds/), and with it every StreamingModel.
    ext = client.ApiextensionsV1Api(admin)
    assert ext.read_custom_resource_definition("streamingmodels.serving.sluice.dev")


def test_streaming_model_chart_passes_the_api_server(h, live_cluster, charts, tmp_path):
    from kubernetes import client

    cp, admin = live_cluster
    _, model_chart = charts
    core = client.CoreV1Api(admin)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name="apps")))
    out = _helm(
        h, cp, "install", "llama", str(model_chart), "-n", "apps",
        "-f", str(HERE / "streaming-model-values-all-on.yaml"),
    ).stdout  # fmt: skip
    assert "STATUS: deployed" in out
    custom = client.CustomObjectsApi(admin)
    sm = custom.get_namespaced_custom_object(
        "serving.sluice.dev", "v1alpha1", "apps", "streamingmodels", "llama-70b"
    )
    values = yaml.safe_load((HERE / "streaming-model-values-all-on.yaml").read_text())
    # As written, plus the schema's default for what the values leave out (one node).
    assert sm["spec"]["parallelism"] == {"nodes": 1, **values["parallelism"]}
    assert sm["spec"]["autoscaling"]["targetTTFTMilliseconds"] == 400

    # tensor x pipeline != gpus: valid for the values schema, refused by the CRD's CEL rule.
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"resources": {"gpus": 4}, "parallelism": {"tensor": 3}}))
    proc = _helm(
        h, cp, "install", "bad", str(model_chart), "-n", "apps", "-f", str(bad), check=False
    )
    assert proc.returncode != 0
    assert "parallelism.tensor x parallelism.pipeline must equal resources.gpus" in proc.stderr

    _helm(h, cp, "uninstall", "llama", "-n", "apps")
    items = custom.list_namespaced_custom_object(
        "serving.sluice.dev", "v1alpha1", "apps", "streamingmodels"
    )
    assert not items["items"]
