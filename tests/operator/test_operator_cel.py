"""The CRD's validation evaluated offline, as the API server would: structural defaulting,
then the OpenAPI schema (strict: unknown fields fail) and every CEL rule, with a real CEL
implementation (cel-python, RE2 regexes). Valid samples pass everything; each invalid
sample fails, and the CEL-guarded ones fail with their documented message. The end-to-end
suite proves the real API server agrees."""

from __future__ import annotations

import copy
import typing
from typing import Any

import jsonschema
import pytest
from operator_helpers import INVALID_SAMPLES, SAMPLES, expectations, load
from sluice_operator.generate.crd import build_crd
from sluice_operator.models.base import ApiModel
from sluice_operator.models.resource import ADAPTER_NAME_RULE, NAME_RULE, SPLIT_SELF_RULE
from sluice_operator.models.spec import StreamingModelSpec
from sluice_operator.validation import SpecError, parse_object, parse_spec

celpy = pytest.importorskip("celpy", reason="cel-python not installed (tests/requirements.txt)")

SCHEMA = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
ENV = celpy.Environment()
# The Kubernetes CEL lists library's sum() (cel-python has the standard macros only).
K8S_FUNCTIONS = {"sum": lambda items: celpy.celtypes.IntType(sum(items))}


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
        program = ENV.program(ENV.compile(v["rule"]), functions=K8S_FUNCTIONS)
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
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for i, item in enumerate(value):  # the API server runs item rules on every item
            failed += cel_failures(node["items"], item, f"{path}[{i}]")
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
        if isinstance(node.get("items"), dict):
            stack.append(node["items"])
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
    assert (
        spec["parallelism"] == {"tensor": 1, "pipeline": 1, "nodes": 1}
        and spec["resources"]["gpus"] == 1
    )
    assert spec["streaming"]["protocols"] == ["sse", "websocket", "responses", "anthropic"]
    assert spec["engine"]["gpuMemoryUtilization"] == 0.92 and "extraArgs" not in spec["engine"]


CASES = pytest.mark.parametrize(
    "spec_patch,message",
    [
        ({"resources": {"gpus": 8}, "parallelism": {"tensor": 4, "pipeline": 2}}, None),
        ({"resources": {"gpus": 8}, "parallelism": {"tensor": 4}}, "must equal resources.gpus"),
        ({"resources": {"gpus": 8}, "parallelism": {"tensor": 8, "pipeline": 2, "nodes": 2}}, None),
        (
            {"resources": {"gpus": 8}, "parallelism": {"tensor": 8, "nodes": 2}},
            "must equal resources.gpus x parallelism.nodes",
        ),
        (
            {"resources": {"gpus": 4}, "parallelism": {"tensor": 4, "pipeline": 2, "nodes": 2}},
            None,
        ),
        ({"parallelism": {"nodes": 2, "pipeline": 2}, "server": {"apiWorkers": 1}}, None),
        (
            {"parallelism": {"nodes": 2, "pipeline": 2}, "server": {"apiWorkers": 2}},
            "cannot be combined with parallelism.nodes",
        ),
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
        # Migration's stall over the heartbeat: only while the router migrates streams.
        (
            {"routing": {"router": {"enabled": True}}, "streaming": {"heartbeatSeconds": 30}},
            "stallSeconds must be greater than streaming.heartbeatSeconds",
        ),
        (
            {
                "routing": {"router": {"enabled": True, "migration": {"stallSeconds": 45.5}}},
                "streaming": {"heartbeatSeconds": 45},
            },
            None,
        ),
        (
            {
                "routing": {"router": {"enabled": True, "migration": {"stallSeconds": 45}}},
                "streaming": {"heartbeatSeconds": 45},
            },
            "stallSeconds must be greater than streaming.heartbeatSeconds",
        ),
        (
            {
                "routing": {"router": {"enabled": True, "migration": {"enabled": False}}},
                "streaming": {"heartbeatSeconds": 60},
            },
            None,
        ),
        ({"streaming": {"heartbeatSeconds": 60}}, None),
        ({"routing": {"router": {"enabled": True}}}, None),
    ],
)


@CASES
def test_cel_rules_directly(spec_patch, message):
    spec = {"model": {"uri": "hf://org/model"}, **spec_patch}
    _, cel_errors = check({"metadata": {"name": "m"}, "spec": spec})
    if message is None:
        assert cel_errors == []
    else:
        assert any(message in m for m in cel_errors), cel_errors


@CASES
def test_the_operator_agrees_with_cel_and_says_the_same_message(spec_patch, message):
    spec = {"model": {"uri": "hf://org/model"}, **spec_patch}
    _, cel_errors = check({"metadata": {"name": "m"}, "spec": spec})
    if message is None:
        parse_spec(spec, name="m")
        return
    with pytest.raises(SpecError) as info:
        parse_spec(spec, name="m")
    (cel_message,) = cel_errors
    assert cel_message in str(info.value) and message in str(info.value)


@pytest.mark.parametrize("path", INVALID_SAMPLES, ids=lambda p: p.stem)
def test_an_invalid_sample_gets_the_same_rule_message_from_both(path):
    """One rule, one message: where CEL refuses a sample, the operator's error carries the
    same message (plus what it found), not a second wording of the rule."""
    _, cel_errors = check(load(path))
    with pytest.raises(SpecError) as info:
        parse_object(load(path))
    assert all(m in str(info.value) for m in cel_errors), (cel_errors, str(info.value))


def test_every_rule_is_in_the_crd_once():
    """The CRD's `x-kubernetes-validations` are the models' `RULES` (and the three root rules),
    nothing written beside them."""
    in_crd = sorted(
        v["message"] for _, n in _nodes(SCHEMA) for v in n.get("x-kubernetes-validations", [])
    )
    rules = sorted(
        [r.message for m in _models(StreamingModelSpec) for r in m.RULES]
        + [NAME_RULE.message, ADAPTER_NAME_RULE.message, SPLIT_SELF_RULE.message]
    )
    assert in_crd == rules and len(rules) >= 12


def _nodes(node: dict[str, Any], path: str = ""):
    yield path, node
    for name, child in (node.get("properties") or {}).items():
        yield from _nodes(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _nodes(node["items"], f"{path}[]")


def _models(model: type) -> set[type]:
    """Every ApiModel reachable from `model` through its fields."""
    seen: set[type] = set()
    stack = [model]
    while stack:
        m = stack.pop()
        if m in seen:
            continue
        seen.add(m)
        for f in m.model_fields.values():
            stack += [
                t for t in _types(f.annotation) if isinstance(t, type) and issubclass(t, ApiModel)
            ]
    return seen


def _types(annotation: Any) -> list[Any]:
    args = typing.get_args(annotation)
    return [annotation, *(t for a in args for t in _types(a))]


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
