"""The CRD's validation evaluated offline, as the API server would: structural defaulting,
then the OpenAPI schema (strict: unknown fields fail) and every CEL rule, with a real CEL
implementation (cel-python, RE2 regexes). Valid samples pass everything; each invalid
sample fails, and the CEL-guarded ones fail with their documented message. The end-to-end
suite proves the real API server agrees."""

from __future__ import annotations

import copy
from typing import Any

import jsonschema
import pytest
from operator_helpers import INVALID_SAMPLES, SAMPLES, expectations, load
from sluice_operator.generate.crd import build_crd

celpy = pytest.importorskip("celpy", reason="cel-python not installed (tests/requirements.txt)")

SCHEMA = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
ENV = celpy.Environment()


def apply_defaults(node: dict[str, Any], value: Any) -> Any:
    """API server structural defaulting: fill absent defaulted fields, then recurse."""
    if isinstance(value, dict) and "properties" in node:
        for name, child in node["properties"].items():
            if name not in value and "default" in child:
                value[name] = copy.deepcopy(child["default"])
            if name in value:
                value[name] = apply_defaults(child, value[name])
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        value = [apply_defaults(node["items"], v) for v in value]
    return value


def to_jsonschema(node: dict[str, Any]) -> dict[str, Any]:
    if node.get("x-kubernetes-preserve-unknown-fields"):
        return {"type": "object"}
    if node.get("x-kubernetes-int-or-string"):
        return {"anyOf": [{"type": "integer"}, {"type": "string"}]}
    out = {
        k: v
        for k, v in node.items()
        if not k.startswith("x-") and k not in ("default", "description")
    }
    if "properties" in node:
        out["properties"] = {k: to_jsonschema(v) for k, v in node["properties"].items()}
        out["additionalProperties"] = False  # kubectl/apiserver strict field validation
    if isinstance(node.get("items"), dict):
        out["items"] = to_jsonschema(node["items"])
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = to_jsonschema(node["additionalProperties"])
    return out


def cel_failures(node: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Messages of the CEL rules that evaluate to false (rules on absent values do not run)."""
    failed = []
    for v in node.get("x-kubernetes-validations", []):
        program = ENV.program(ENV.compile(v["rule"]))
        try:
            result = program.evaluate({"self": celpy.json_to_cel(value)})
        except celpy.CELEvalError as exc:  # e.g. "no such member": the API server rejects too
            result = exc
        if isinstance(result, celpy.CELEvalError):
            failed.append(f"{path}: error evaluating {v['rule']}: {result}")
        elif not bool(result):
            failed.append(v["message"])
    if isinstance(value, dict):
        for name, child in (node.get("properties") or {}).items():
            if name in value and name != "metadata":
                failed += cel_failures(child, value[name], f"{path}.{name}")
    return failed


def check(body: dict[str, Any]) -> tuple[list[str], list[str]]:
    obj = apply_defaults(SCHEMA, copy.deepcopy(body))
    validator = jsonschema.Draft4Validator(
        to_jsonschema({**SCHEMA, "properties": {**SCHEMA["properties"]}})
    )
    schema_errors = [
        f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(obj)
    ]
    return schema_errors, cel_failures(SCHEMA, obj)


def test_every_rule_compiles():
    count = 0
    stack = [SCHEMA]
    while stack:
        node = stack.pop()
        for v in node.get("x-kubernetes-validations", []):
            ENV.compile(v["rule"])
            count += 1
        stack += list((node.get("properties") or {}).values())
    assert count >= 6


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_valid_samples_pass_schema_and_cel(path):
    schema_errors, cel_errors = check(load(path))
    assert schema_errors == [] and cel_errors == []


@pytest.mark.parametrize("path", INVALID_SAMPLES, ids=lambda p: p.stem)
def test_invalid_samples_fail_schema_or_cel(path):
    schema_errors, cel_errors = check(load(path))
    assert schema_errors or cel_errors, "accepted"
    expected = expectations(path)["expect-apiserver"]
    cel_messages = [m for m in cel_errors if not m.startswith(".")]
    if any(expected in m for m in cel_messages):
        return
    # Not a CEL message: it must be a schema failure (bounds, enum, minItems, unknown field).
    assert schema_errors, f"expected {expected!r}, CEL said {cel_errors}"
    assert not [m for m in cel_errors if "error evaluating" in m], cel_errors


def test_defaults_make_nested_objects_whole():
    obj = apply_defaults(SCHEMA, {"metadata": {"name": "m"}, "spec": {"model": {"uri": "tiny"}}})
    spec = obj["spec"]
    assert spec["parallelism"] == {"tensor": 1, "pipeline": 1} and spec["resources"]["gpus"] == 1
    assert spec["streaming"]["protocols"] == ["sse", "websocket", "responses", "anthropic"]
    assert spec["engine"]["gpuMemoryUtilization"] == 0.92 and "extraArgs" not in spec["engine"]


@pytest.mark.parametrize(
    "spec_patch,message",
    [
        ({"resources": {"gpus": 8}, "parallelism": {"tensor": 4, "pipeline": 2}}, None),
        ({"resources": {"gpus": 8}, "parallelism": {"tensor": 4}}, "must equal resources.gpus"),
        ({"engine": {"extraArgs": ["--enable-prefix-caching"]}}, None),
        ({"engine": {"extraArgs": ["--model=x"]}}, "extraArgs must not repeat"),
        ({"engine": {"extraArgs": ["--max-model-len", "9"]}}, "extraArgs must not repeat"),
        ({"model": {"uri": "hf://org/name@v1.0"}}, None),
        ({"model": {"uri": "pvc://My_Claim/x"}}, "model.uri"),
        ({"ingress": {"host": "a.example.com", "tlsSecretName": "t"}}, None),
        ({"autoscaling": {"minReplicas": 3, "maxReplicas": 3}}, None),
        ({"autoscaling": {"minReplicas": 4}}, None),  # the default maxReplicas is 4
        ({"autoscaling": {"minReplicas": 5}}, "minReplicas must not exceed"),
        ({"server": {"queue": {"size": 8, "priorities": ["a", "b"]}}}, None),
        ({"server": {"queue": {"timeoutSeconds": 5}}}, "server.queue needs size"),
        (
            {"server": {"queue": {"size": 8, "priorities": ["a"], "defaultPriority": "c"}}},
            "defaultPriority must be one of server.queue.priorities",
        ),
        (
            {"server": {"queue": {"size": 8, "defaultPriority": "c"}}},
            "defaultPriority must be one of server.queue.priorities",
        ),
        (
            {"server": {"queue": {"size": 8, "tenantWeights": {"acme": 0}}}},
            "every weight is a whole number from 1 to 1000",
        ),
    ],
)
def test_cel_rules_directly(spec_patch, message):
    spec = {"model": {"uri": "hf://org/model"}, **spec_patch}
    _, cel_errors = check({"metadata": {"name": "m"}, "spec": spec})
    if message is None:
        assert cel_errors == []
    else:
        assert any(message in m for m in cel_errors), cel_errors


def test_name_rule():
    _, errors = check({"metadata": {"name": "Bad.Name"}, "spec": {"model": {"uri": "tiny"}}})
    assert any("DNS-1035" in m for m in errors)


def test_unguarded_rule_on_absent_field_is_an_error():
    # Negative control: the extraArgs rule without its has() guard breaks every object
    # that leaves extraArgs out, which is what the API server does too.
    node = {
        "type": "object",
        "properties": {"extraArgs": {"type": "array", "items": {"type": "string"}}},
        "x-kubernetes-validations": [{"rule": "self.extraArgs.all(a, a != '')", "message": "m"}],
    }
    (failure,) = cel_failures(node, {})
    assert "error evaluating" in failure


def test_rules_hold_on_every_default_as_written():
    """The API server validates each `default` in the CRD by its node's rules as written,
    without filling the defaults nested inside it (a rule reading `self.maxSurge` on the
    default `{}` makes the whole CRD invalid). Negative control: such a rule is caught."""
    checked, stack = 0, [SCHEMA]
    while stack:
        node = stack.pop()
        if "default" in node and node.get("x-kubernetes-validations"):
            assert cel_failures(node, copy.deepcopy(node["default"])) == [], node["default"]
            checked += 1
        stack += list((node.get("properties") or {}).values())
    assert checked >= 1
    bad = {"default": {}, "x-kubernetes-validations": [{"rule": "self.a > 0", "message": "m"}]}
    assert cel_failures(bad, {}) != []
