"""Item 4, API side: the API server itself enforces the CRD's schema and CEL rules.

Each file in samples/invalid/ names the message the API server must answer with in an
`# expect-apiserver:` comment; the tests create them (server-side dry run, strict field
validation as kubectl does) and compare. Valid samples must pass the same door.
"""

from __future__ import annotations

import copy
import json
import re

import pytest
import yaml
from e2e_harness.kube import GROUP, PLURAL, SAMPLES, VERSION
from kubernetes import client

INVALID = sorted((SAMPLES / "invalid").glob("*.yaml"))
VALID = sorted(SAMPLES.glob("*.yaml"))


def _expected(path) -> str:
    match = re.search(r"^# expect-apiserver: (.+)$", path.read_text(), re.M)
    assert match, f"{path.name} has no '# expect-apiserver:' comment"
    return match.group(1).strip()


def _create(admin, body: dict, dry_run: bool = True) -> dict:
    body = copy.deepcopy(body)
    body["metadata"]["namespace"] = "default"
    return client.CustomObjectsApi(admin).create_namespaced_custom_object(
        GROUP,
        VERSION,
        "default",
        PLURAL,
        body,
        dry_run="All" if dry_run else None,
        field_validation="Strict",
    )


def _rejection(admin, body: dict) -> tuple[int, str]:
    """(HTTP status, the message a user sees) of a refused create."""
    with pytest.raises(client.ApiException) as err:
        _create(admin, body)
    return err.value.status, json.loads(err.value.body)["message"]


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.name)
def test_valid_samples_are_accepted(admin, crd, path):
    created = _create(admin, yaml.safe_load(path.read_text()))
    # Defaults from the schema are filled in by the API server.
    assert created["spec"]["engine"]["gpuMemoryUtilization"] == pytest.approx(
        yaml.safe_load(path.read_text())["spec"].get("engine", {}).get("gpuMemoryUtilization", 0.92)
    )


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_invalid_samples_are_rejected_with_readable_messages(admin, crd, path):
    status, message = _rejection(admin, yaml.safe_load(path.read_text()))
    assert status in (400, 422), message
    assert _expected(path) in message, message


BASE = {
    "apiVersion": f"{GROUP}/{VERSION}",
    "kind": "StreamingModel",
    "metadata": {"name": "probe"},
    "spec": {"model": {"uri": "hf://org/model"}},
}


@pytest.mark.parametrize(
    ("spec", "field", "words"),
    [
        (
            {"resources": {"gpus": 4}, "parallelism": {"tensor": 3}},
            "spec",
            "must equal resources.gpus",
        ),
        (
            {"resources": {"gpus": 4}, "parallelism": {"tensor": 2, "pipeline": 3}},
            "spec",
            "must equal resources.gpus",
        ),
        ({"streaming": {"protocols": []}}, "spec.streaming.protocols", "at least 1"),
        (
            {"streaming": {"protocols": ["sse", "grpc"]}},
            "spec.streaming.protocols",
            "supported values",
        ),
        ({"engine": {"gpuMemoryUtilization": 1.5}}, "spec.engine.gpuMemoryUtilization", "0.98"),
        ({"engine": {"gpuMemoryUtilization": 0.2}}, "spec.engine.gpuMemoryUtilization", "0.5"),
    ],
    ids=["tp3-gpus4", "tp2xpp3-gpus4", "no-protocols", "unknown-protocol", "gmu-1.5", "gmu-0.2"],
)
def test_cel_and_schema_rules_name_the_field(admin, crd, spec, field, words):
    body = copy.deepcopy(BASE)
    body["spec"].update(spec)
    status, message = _rejection(admin, body)
    assert status == 422, message
    assert field in message and words in message, message


def test_tp_times_pp_equal_to_gpus_is_accepted(admin, crd):
    """Positive control for the rule above."""
    body = copy.deepcopy(BASE)
    body["spec"].update({"resources": {"gpus": 8}, "parallelism": {"tensor": 4, "pipeline": 2}})
    assert _create(admin, body)["spec"]["parallelism"] == {"tensor": 4, "pipeline": 2, "nodes": 1}


def test_tp_times_pp_equal_to_gpus_times_nodes_is_accepted(admin, crd):
    """Positive control for the same rule on several nodes (gpus is per node)."""
    body = copy.deepcopy(BASE)
    body["metadata"]["name"] = "two-nodes"
    body["spec"].update(
        {"resources": {"gpus": 8}, "parallelism": {"tensor": 8, "pipeline": 2, "nodes": 2}}
    )
    assert _create(admin, body)["spec"]["parallelism"]["nodes"] == 2


def _vllm_reserved_spellings() -> list[str]:
    """Every option string vLLM's parser has for a flag the operator sets, its underscore
    spelling and its shortest abbreviations (read from vLLM, not from our list)."""
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        return []
    from sluice_operator.models.flags import RESERVED_VLLM_DESTS

    parser = make_arg_parser(FlexibleArgumentParser())
    out = []
    for action in parser._actions:
        if action.dest in RESERVED_VLLM_DESTS:
            for option in action.option_strings:
                out += [option, f"{option}=2"]
                if option.startswith("--"):
                    out += ["--" + option[2:].replace("-", "_"), option[:-1]]
    return sorted(set(out))


def test_every_vllm_spelling_of_a_reserved_flag_is_rejected(admin, crd):
    spellings = _vllm_reserved_spellings()
    if not spellings:
        pytest.skip("vllm is not installed")
    body = yaml.safe_load((SAMPLES / "chat-small.yaml").read_text())
    accepted = []
    for arg in spellings:
        bad = copy.deepcopy(body)
        bad["spec"].setdefault("engine", {})["extraArgs"] = [arg]
        try:
            status, message = _rejection(admin, bad)
        except pytest.fail.Exception:
            accepted.append(arg)
            continue
        assert status == 422 and "engine.extraArgs must not repeat flags" in message, message
    assert accepted == [], accepted
