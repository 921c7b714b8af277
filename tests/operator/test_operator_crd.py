"""The CRD: generated from the models, checked in up to date, structural, valid, teaching."""

from __future__ import annotations

import re
from typing import Any

import kubernetes_validate
import pytest
import yaml
from operator_helpers import INVALID_SAMPLES, SAMPLES, expectations, load
from sluice_operator.generate import chartdocs
from sluice_operator.generate.crd import build_crd, render_crd
from sluice_operator.generate.outputs import CRD_PATHS, stale_files
from sluice_operator.models.engine import MODEL_URI_PATTERN
from sluice_operator.models.flags import RESERVED_RE
from sluice_operator.validation import SpecError, parse_object
from testkit.k8s import K8S_VERSIONS
from testkit.repo import ROOT

CRD = build_crd()
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]

# Keys a structural schema may not use (apiextensions "Specifying a structural schema").
FORBIDDEN = {
    "$ref",
    "definitions",
    "dependencies",
    "patternProperties",
    "additionalItems",
    "nullable_false",
}


def walk(node: dict[str, Any], path: str = ""):
    yield path, node
    for name, child in (node.get("properties") or {}).items():
        yield from walk(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}{{}}")


def test_checked_in_crd_is_up_to_date():
    stale = stale_files(ROOT)
    assert not stale, f"regenerate with `make crds`: {stale}"


def test_chart_copy_is_identical():
    a, b = (ROOT / p for p in CRD_PATHS)
    assert a.read_text() == b.read_text() == render_crd()


def test_stale_detection_has_teeth(tmp_path):
    # Negative control: a copy with one description changed must be reported stale.
    for rel in CRD_PATHS:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(
            render_crd().replace("Which model to serve.", "Edited by hand.")
        )
    # The hand-edited CRD, and the other generated files, missing from the copy.
    assert {p.name for p in stale_files(tmp_path)} == {
        CRD_PATHS[0].name,
        "api.md",
        "values.schema.json",
        "grafana-dashboard.json",
        "helm.md",
    }


def test_a_new_chart_value_is_a_regenerate_step(tmp_path):
    """docs/helm.md's tables come from the charts: a value added to values.yaml with its
    `# --` comment shows up in the table once regenerated, and the checked-in file is stale
    until then; a value without a comment is refused."""
    for rel in (chartdocs.HELM_DOC, chartdocs.OPERATOR_VALUES, chartdocs.MODEL_VALUES,
                chartdocs.RBAC_RULES):  # fmt: skip
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text((ROOT / rel).read_text())
    assert chartdocs.render_helm_doc(tmp_path) == (ROOT / chartdocs.HELM_DOC).read_text()
    values = tmp_path / chartdocs.OPERATOR_VALUES
    values.write_text(values.read_text() + "# -- Seconds between two widgets.\nwidgetSeconds: 15\n")
    doc = chartdocs.render_helm_doc(tmp_path)
    assert "| `widgetSeconds` | int | `15` | Seconds between two widgets. |" in doc
    assert doc != (ROOT / chartdocs.HELM_DOC).read_text()
    values.write_text(values.read_text() + "undocumented: 1\n")
    with pytest.raises(ValueError, match="without a `# --` comment: undocumented"):
        chartdocs.render_helm_doc(tmp_path)


@pytest.mark.parametrize(
    "path,node", list(walk(SCHEMA)), ids=lambda v: v if isinstance(v, str) else ""
)
def test_schema_is_structural(path, node):
    assert not FORBIDDEN & node.keys(), path
    typed = (
        "type" in node
        or node.get("x-kubernetes-int-or-string")
        or node.get("x-kubernetes-preserve-unknown-fields")
    )
    assert typed, f"{path or '<root>'} has no type"
    assert not ("properties" in node and "additionalProperties" in node), path
    assert "anyOf" not in node and "oneOf" not in node and "title" not in node, path
    assert node.get("uniqueItems") is not True, path
    if path.startswith(".spec") and path.count(".") >= 2 and not path.endswith(("[]", "{}")):
        assert node.get("description"), f"{path} needs a description for kubectl explain"


def test_every_spec_field_has_description_and_default_or_is_optional():
    spec = SCHEMA["properties"]["spec"]
    required = spec["required"]
    assert required == ["model"]
    for name, node in spec["properties"].items():
        assert node["description"]
        if (
            node.get("type") == "object"
            and name not in ("autoscaling", "disaggregation", "gateway", "model")
            and "additionalProperties" not in node
        ):
            assert node.get("default") == {}, f"{name}: nested defaults only apply under a default"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_crd_validates_against_kubernetes_schema(version):
    kubernetes_validate.validate(CRD, version, strict=True)


def test_crd_negative_control_is_rejected():
    broken = yaml.safe_load(render_crd())
    broken["spec"]["scope"] = 7
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[0], strict=True)


def test_envelope():
    spec = CRD["spec"]
    assert spec["group"] == "serving.sluice.dev" and spec["scope"] == "Namespaced"
    assert set(spec["names"]["shortNames"]) == {"sm", "smodel"}
    version = spec["versions"][0]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert {"Model", "GPUs", "TP", "Protocols", "Ready", "URL", "Age"} <= columns.keys()
    assert columns["URL"].get("priority") == 1 and "priority" not in columns["Model"]


def test_bounds_and_enums():
    spec = SCHEMA["properties"]["spec"]["properties"]
    gmu = spec["engine"]["properties"]["gpuMemoryUtilization"]
    assert (gmu["minimum"], gmu["maximum"], gmu["default"]) == (0.5, 0.98, 0.92)
    protocols = spec["streaming"]["properties"]["protocols"]
    assert protocols["minItems"] == 1
    assert protocols["items"]["enum"] == ["sse", "websocket", "responses", "anthropic"]
    assert protocols["x-kubernetes-list-type"] == "set"
    assert spec["resources"]["properties"]["sharedMemorySize"]["x-kubernetes-int-or-string"] is True
    conditions = SCHEMA["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"


def _rules(node: dict) -> list[str]:
    return [v["rule"] for v in node.get("x-kubernetes-validations", [])]


def test_cel_rules_present_with_messages():
    spec = SCHEMA["properties"]["spec"]
    assert (
        "self.parallelism.tensor * self.parallelism.pipeline == self.resources.gpus * "
        "(has(self.parallelism.nodes) ? self.parallelism.nodes : 1)"
    ) in _rules(spec)
    assert "self.minReplicas <= self.maxReplicas" in _rules(spec["properties"]["autoscaling"])
    assert "!has(self.tlsSecretName) || has(self.host)" in _rules(spec["properties"]["ingress"])
    assert any("matches" in r for r in _rules(spec["properties"]["model"]))
    assert any("metadata.name" in r for r in _rules(SCHEMA))
    for _, node in walk(SCHEMA):
        for v in node.get("x-kubernetes-validations", []):
            assert len(v["message"]) > 20 and "\n" not in v["message"]
            # CEL single-quoted literals: a backslash would be an escape sequence there.
            assert "\\" not in v["rule"], v["rule"]


def test_cel_lists_and_strings_are_bounded():
    # The API server refuses CEL rules whose estimated cost is unbounded.
    engine = SCHEMA["properties"]["spec"]["properties"]["engine"]["properties"]
    assert engine["extraArgs"]["maxItems"] and engine["extraArgs"]["items"]["maxLength"]
    assert SCHEMA["properties"]["spec"]["properties"]["model"]["properties"]["uri"]["maxLength"]


@pytest.mark.parametrize(
    "uri,ok",
    [
        ("hf://Qwen/Qwen2.5-0.5B-Instruct", True),
        ("hf://gpt2", True),
        ("hf://meta-llama/Llama-3.3-70B-Instruct@main", True),
        ("pvc://store/models/llama", True),
        ("pvc://store", True),
        ("/models/x", True),
        ("tiny", True),
        ("s3://bucket/x", False),
        ("hf://org/name/extra", False),
        ("pvc://Bad_Claim/x", False),
        ("/models/with space", False),
        ("org/name", False),
    ],
)
def test_model_uri_pattern(uri, ok):
    # The same pattern is in the CEL rule (RE2); these cases use only syntax RE2 and re share.
    assert bool(re.match(MODEL_URI_PATTERN, uri)) is ok


def test_reserved_flag_pattern():
    assert re.match(RESERVED_RE, "--tensor-parallel-size=2")
    assert re.match(RESERVED_RE, "--model")
    assert not re.match(RESERVED_RE, "--enable-prefix-caching")
    assert not re.match(RESERVED_RE, "--model-loader-extra-config={}")


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_valid_samples_pass_the_operator(path):
    parse_object(load(path))


@pytest.mark.parametrize("path", INVALID_SAMPLES, ids=lambda p: p.stem)
def test_invalid_samples_are_rejected_readably(path):
    expected = expectations(path)
    assert expected.get("expect-operator") and expected.get("expect-apiserver"), (
        "document both messages"
    )
    with pytest.raises(SpecError) as info:
        parse_object(load(path))
    assert expected["expect-operator"] in str(info.value)


@pytest.mark.parametrize("path", INVALID_SAMPLES, ids=lambda p: p.stem)
def test_invalid_samples_have_a_schema_or_cel_guard(path):
    # The API-server side message must come from something in the CRD: a CEL message, or a
    # standard OpenAPI/strict-decoding message for a bound/enum/unknown field we declare.
    message = expectations(path)["expect-apiserver"]
    cel_messages = [
        v["message"] for _, n in walk(SCHEMA) for v in n.get("x-kubernetes-validations", [])
    ]
    standard = (
        "should have at least 1 items",
        "less than or equal to",
        "Unsupported value",
        "must have at most",
    )
    unknown_field = re.fullmatch(r"spec(\.[A-Za-z]+)+", message) and not _declared(message)
    assert (
        any(message in m for m in cel_messages)
        or any(s in message for s in standard)
        or unknown_field
    ), message
    # The API server's JSON error body escapes quotes, so the expectation must not have any.
    assert '"' not in message


def _declared(dotted: str) -> bool:
    node = SCHEMA
    for name in dotted.split("."):
        node = (node.get("properties") or {}).get(name)
        if node is None:
            return False
    return True


def _present_after_defaulting(
    node: dict, dotted: list[str], rule: str, prefix: str = "self"
) -> bool:
    """Every step of self.a.b is required, defaulted, or guarded by has() in the rule."""
    for name in dotted:
        props = node.get("properties") or {}
        if name not in props:
            return False
        child = props[name]
        here = f"{prefix}.{name}"
        if (
            name not in node.get("required", [])
            and "default" not in child
            and f"has({here})" not in rule
        ):
            return False
        node, prefix = child, here
    return True


def test_cel_rules_only_touch_fields_that_exist_after_defaulting():
    # A rule reading an absent optional field fails at admission ("no such key") and would
    # reject every object that leaves the field out.
    checked = 0
    for path, node in walk(SCHEMA):
        for v in node.get("x-kubernetes-validations", []):
            for ref in re.findall(r"self((?:\.[A-Za-z]\w*)+)", v["rule"]):
                dotted = ref.strip(".").split(".")
                if dotted[0] == "metadata":
                    continue
                dotted = [d for d in dotted
                          if d not in ("size", "matches", "all", "filter", "startsWith", "map", "sum")]  # fmt: skip
                assert _present_after_defaulting(node, dotted, v["rule"]), (
                    f"{path}: {v['rule']} reads self.{ref}"
                )
                checked += 1
    assert checked >= 6


def test_unguarded_optional_reference_is_caught():
    node = {"properties": {"x": {"type": "array"}}}
    assert not _present_after_defaulting(node, ["x"], "self.x.all(a, a != '')")
    assert _present_after_defaulting(node, ["x"], "!has(self.x) || self.x.all(a, a != '')")


def test_readme_names_the_printer_columns_kubectl_shows():
    """The README's `kubectl get streamingmodels` lines list exactly the default columns, and
    the `-o wide` line exactly the wide-only (priority 1) ones, in the CRD's order."""
    from sluice_operator.generate.crd import PRINTER_COLUMNS

    text = (ROOT / "README.md").read_text()
    default = re.search(r"^kubectl get streamingmodels +# (.+)$", text, re.M)
    wide = re.search(r"^kubectl get streamingmodels -o wide +# adds (.+)$", text, re.M)
    assert default and wide, "README.md lost its kubectl get streamingmodels lines"
    assert default.group(1).split(", ") == [
        c["name"] for c in PRINTER_COLUMNS if not c.get("priority")
    ]
    assert wide.group(1).split(", ") == [c["name"] for c in PRINTER_COLUMNS if c.get("priority")]
