"""Every manifest the operator renders for every sample validates against the official
Kubernetes schemas (kubernetes-validate, strict: unknown fields fail) for two versions."""

from __future__ import annotations

import subprocess
import sys

import kubernetes_validate
import pytest
import yaml
from operator_helpers import SAMPLES, FakeCluster, body_of, load, validate_manifest
from sluice_operator.models.resource import OperatorDefaults
from sluice_operator.reconcile import converge
from sluice_operator.render import render_objects
from testkit.k8s import K8S_VERSIONS
from testkit.repo import ROOT

CASES = [(p, v) for p in SAMPLES for v in K8S_VERSIONS]
# The operator as the chart runs it: router models also get their continuation-key Secret.
KEYED = OperatorDefaults(continuation_key=b"master")


def test_k8s_versions_are_in_the_installed_schemas():
    available = kubernetes_validate.utils.all_versions()
    for version in K8S_VERSIONS:
        assert any(v.startswith(version + ".") for v in available), (version, available)


@pytest.mark.parametrize("path,version", CASES, ids=[f"{p.stem}-{v}" for p, v in CASES])
def test_rendered_manifests_validate(path, version):
    manifests = render_objects(load(path), defaults=KEYED)
    workload = "LeaderWorkerSet" if "nodes: 2" in path.read_text() else "Deployment"
    assert {m["kind"] for m in manifests} >= {workload, "Service"}
    for manifest in manifests:
        validate_manifest(manifest, version)


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_applied_manifests_with_owner_references_validate(path):
    # What the operator actually sends (after kopf.adopt and the hash annotation).
    cluster = FakeCluster()
    converge(cluster, body_of(path), lambda *a: None, now="2026-11-30T00:00:00Z", defaults=KEYED)
    for obj in cluster.objects.values():
        sent = {k: v for k, v in obj.items() if k != "status"}
        sent["metadata"] = {
            k: v for k, v in sent["metadata"].items() if k not in ("generation", "uid")
        }
        if sent["kind"] == "Service":
            sent["spec"] = {k: v for k, v in sent["spec"].items() if k != "clusterIP"}
        validate_manifest(sent, K8S_VERSIONS[-1])


def test_validation_negative_control():
    manifest = render_objects(load(SAMPLES[0]))[1]
    assert manifest["kind"] == "Deployment"
    manifest["spec"]["strategy"]["rollingUpdate"]["maxSurgeTypo"] = 0
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(manifest, K8S_VERSIONS[0], strict=True)


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "sluice_operator", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_render_cli_prints_all_manifests():
    result = _cli("render", "-f", "samples/llama-70b-tp4.yaml")
    assert result.returncode == 0, result.stderr
    kinds = [d["kind"] for d in yaml.safe_load_all(result.stdout) if d]
    assert kinds == [
        "Service",
        "Deployment",
        "Ingress",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
    ]


def test_render_cli_rejects_invalid_sample_readably():
    result = _cli("render", "-f", "samples/invalid/empty-protocols.yaml")
    assert result.returncode != 0
    assert "spec.streaming.protocols" in result.stderr and "Traceback" not in result.stderr


def test_crds_check_cli():
    assert _cli("crds", "--check").returncode == 0
    printed = _cli("crds").stdout
    assert (ROOT / "crds/streamingmodels.serving.sluice.dev.yaml").read_text() == printed


def test_render_reads_stdin_and_skips_other_documents():
    text = (
        "apiVersion: v1\nkind: Secret\nmetadata: {name: x}\n---\n"
        + (ROOT / "samples/chat-small.yaml").read_text()
    )
    result = subprocess.run(
        [sys.executable, "-m", "sluice_operator", "render", "-f", "-", "-n", "team-a"],
        input=text,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    assert [d["kind"] for d in docs] == ["Service", "Deployment"]
    assert {d["metadata"]["namespace"] for d in docs} == {"default"}  # the file's namespace wins
