"""charts/streaming-model: one StreamingModel from values. Rendered by the real helm binary,
validated against the generated CRD's schema (jsonschema) and the operator's own parser,
with a values schema generated from the same CRD."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from .chartlib import (
    HERE,
    MODEL_CHART,
    by_kind,
    documented_keys,
    load_crd,
    one,
    validate_k8s,
    validate_streaming_model,
)

ALL_ON = HERE / "streaming-model-values-all-on.yaml"
# spec.gateway excludes the Ingress that ALL_ON turns on: its own values file.
GATEWAY_ON = HERE / "streaming-model-values-gateway.yaml"
# Disaggregated pools (exclusive with the all-on values' autoscaling).
DISAGGREGATED = HERE / "streaming-model-values-disaggregated.yaml"
RECOMMENDED = MODEL_CHART / "values-recommended.yaml"
# Values of the chart itself, not copied into the spec.
CHART_KEYS = [
    "nameOverride",
    "labels",
    "annotations",
    "test.enabled",
    "test.image",
    "test.timeoutSeconds",
]


def _spec_props() -> dict:
    crd = load_crd()
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"
    ]


@pytest.mark.parametrize("values", [[], [ALL_ON]], ids=["defaults", "all-on"])
def test_lint_strict(h, values):
    args = ["lint", "--strict", str(MODEL_CHART)]
    for v in values:
        args += ["-f", str(v)]
    out = h.run(*args).stdout
    assert "0 chart(s) failed" in out and "[WARNING]" not in out


@pytest.mark.parametrize(
    "values",
    [[], [ALL_ON], [GATEWAY_ON], [DISAGGREGATED]],
    ids=["defaults", "all-on", "gateway", "disaggregated"],
)
def test_renders_one_valid_streaming_model(h, values):
    docs = h.template(MODEL_CHART, values=values, namespace="team-a", release="chat")
    assert sorted(d["kind"] for d in docs) == ["Pod", "StreamingModel"]  # the Pod is the helm test
    sm = one(docs, "StreamingModel")
    validate_k8s(one(docs, "Pod"))
    validate_streaming_model(sm)
    assert sm["metadata"]["namespace"] == "team-a"
    # The operator's own parser (the same rules as the CRD's CEL) accepts it too.
    validation = pytest.importorskip("sluice_operator.validation")
    validation.parse_object(sm)


def test_defaults_render_only_the_model(h):
    sm = one(h.template(MODEL_CHART, release="chat"), "StreamingModel")
    assert sm["metadata"]["name"] == "chat"
    assert sm["spec"] == {"model": {"uri": "hf://Qwen/Qwen2.5-0.5B-Instruct"}}
    assert "annotations" not in sm["metadata"]
    assert sm["metadata"]["labels"]["app.kubernetes.io/part-of"] == "sluice"


def test_all_on_passes_every_section_through(h):
    sm = one(h.template(MODEL_CHART, values=[ALL_ON]), "StreamingModel")
    values = yaml.safe_load(ALL_ON.read_text())
    assert sm["metadata"]["name"] == "llama-70b"
    assert sm["metadata"]["labels"]["team"] == "research"
    assert sm["metadata"]["annotations"] == {"example.com/owner": "research"}
    for key in _spec_props():
        if key not in ("gateway", "disaggregation"):
            assert sm["spec"][key] == values[key], key
    gateway = one(h.template(MODEL_CHART, values=[GATEWAY_ON]), "StreamingModel")
    assert gateway["spec"]["gateway"] == yaml.safe_load(GATEWAY_ON.read_text())["gateway"]
    pools = one(h.template(MODEL_CHART, values=[DISAGGREGATED]), "StreamingModel")
    given = yaml.safe_load(DISAGGREGATED.read_text())["disaggregation"]
    assert pools["spec"]["disaggregation"] == given


def test_spec_keys_follow_the_crd():
    """A new spec field fails here until the chart copies it and values.yaml documents it."""
    helpers = (MODEL_CHART / "templates" / "_helpers.tpl").read_text()
    listed = re.search(r"toJson \(list ([^)]*)\)", helpers).group(1)
    keys = json.loads("[" + ", ".join(listed.split()) + "]")
    assert sorted(keys) == sorted(_spec_props())
    documented, undocumented = documented_keys(MODEL_CHART / "values.yaml")
    assert not undocumented
    assert sorted(documented) == sorted([*CHART_KEYS, *keys])


def test_values_schema_is_generated_from_the_crd():
    values_schema = pytest.importorskip("sluice_operator.generate.values_schema")
    on_disk = (MODEL_CHART / "values.schema.json").read_text()
    assert on_disk == values_schema.render_values_schema(load_crd()), "regenerate with `make crds`"
    schema = values_schema.build_schema(load_crd())
    assert set(schema["properties"]) == {
        "nameOverride",
        "labels",
        "annotations",
        "test",
        *_spec_props(),
    }
    assert "x-kubernetes" not in on_disk


def test_zero_and_false_are_rendered_empty_is_not(h):
    sm = one(
        h.template(MODEL_CHART, set_=["replicas=0", "autoscaling.enabled=false"]), "StreamingModel"
    )
    assert sm["spec"]["replicas"] == 0
    assert sm["spec"]["autoscaling"] == {"enabled": False}
    for key in (
        "resources",
        "engine",
        "ingress",
        "image",
        "imagePullSecrets",
        "serviceAccountName",
    ):
        assert key not in sm["spec"]


@pytest.mark.parametrize(
    "values,message",
    [
        ({"engine": {"gpuMemoryUtilization": 1.5}}, "/engine/gpuMemoryUtilization"),
        ({"streaming": {"protocols": []}}, "/streaming/protocols"),
        ({"streaming": {"protocols": ["sse", "grpc"]}}, "/streaming/protocols/1"),
        ({"engine": {"maxModelLenn": 4096}}, "maxModelLenn"),
        ({"modle": {"uri": "x"}}, "modle"),
        ({"nameOverride": "9-lives"}, "/nameOverride"),
    ],
    ids=[
        "gpu-memory-utilization",
        "empty-protocols",
        "unknown-protocol",
        "typo",
        "unknown-top-level",
        "bad-name",
    ],
)
def test_values_schema_rejects_invalid_specs(h, tmp_path, values, message):
    f = tmp_path / "values.yaml"
    f.write_text(yaml.safe_dump(values))
    proc = h.run("template", "chat", str(MODEL_CHART), "-f", str(f), check=False)
    assert proc.returncode != 0
    assert "values don't meet the specifications of the schema" in proc.stderr
    assert message in proc.stderr, proc.stderr


def test_release_name_that_is_not_a_dns_1035_label_is_refused(h):
    proc = h.run("template", "9chat", str(MODEL_CHART), check=False)
    assert proc.returncode != 0 and "must be a DNS-1035 label" in proc.stderr
    sm = one(h.template(MODEL_CHART, release="9chat", set_=["nameOverride=chat"]), "StreamingModel")
    assert sm["metadata"]["name"] == "chat"


def test_helm_test_pod_waits_for_ready_and_is_hardened(h):
    docs = h.template(MODEL_CHART, release="chat", namespace="team-a")
    pod = one(docs, "Pod")
    assert pod["metadata"]["name"] == "chat-test-ready"
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (c,) = pod["spec"]["containers"]
    script = c["command"][2]
    assert 'url="http://chat.team-a.svc:8000/ready"' in script
    assert "+ 1800" in script and "exit 1" in script
    assert pod["spec"]["restartPolicy"] == "Never"
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert not by_kind(h.template(MODEL_CHART, set_=["test.enabled=false"]), "Pod")
    long = one(h.template(MODEL_CHART, set_=["nameOverride=" + "m" * 63]), "Pod")
    assert len(long["metadata"]["name"]) <= 63


@pytest.mark.parametrize(
    "values",
    [[], [ALL_ON], [GATEWAY_ON], [RECOMMENDED], [DISAGGREGATED]],
    ids=["defaults", "all-on", "gateway", "recommended", "disaggregated"],
)
def test_operator_renders_valid_children_for_the_chart_output(h, values):
    """Chart output -> the operator's own builders -> manifests valid for Kubernetes."""
    render = pytest.importorskip("sluice_operator.render")
    sm = one(
        h.template(MODEL_CHART, values=values, namespace="team-a", release="chat"), "StreamingModel"
    )
    children = render.render_objects(sm)
    kinds = {c["kind"] for c in children}
    assert {"Deployment", "Service"} <= kinds
    if values == [DISAGGREGATED]:
        names = {c["metadata"]["name"] for c in children if c["kind"] == "Deployment"}
        assert names == {"chat-prefill", "chat-decode"}
    if values == [ALL_ON]:
        assert {"Ingress", "HorizontalPodAutoscaler", "PodDisruptionBudget", "PodMonitor"} <= kinds
    if values == [GATEWAY_ON]:
        assert "HTTPRoute" in kinds and "Ingress" not in kinds
    # The model pods' NetworkPolicy: off by default, on in the recommended values; a router
    # model's KV ports (events, the pools' side channel) get one of their own.
    policies = {c["metadata"]["name"] for c in children if c["kind"] == "NetworkPolicy"}
    if values == [DISAGGREGATED]:
        assert policies == {"chat-kv-events"}
    else:
        assert bool(policies) is (values in ([ALL_ON], [RECOMMENDED]))
    for child in children:
        validate_k8s(child)
