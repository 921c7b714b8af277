"""LoRA adapters as the builders render them: the engine flags in the pod template, the
adapter list in its own ConfigMap, and the pod template unchanged by adapter changes."""

from __future__ import annotations

import json

import kubernetes_validate
import pytest
from operator_helpers import minimal
from sluice_operator.builders.adapters import (
    adapter_id,
    desired_adapter_config_map,
    lora_args,
)
from sluice_operator.builders.args import server_args
from sluice_operator.builders.deployment import desired_deployment
from sluice_operator.kinds import ADAPTER_CONFIG_MAP, CHILD_KINDS, DEPLOYMENT, desired_children
from sluice_operator.validation import SpecError, load_model

SUPPORT = {"name": "support-v2", "uri": "pvc://adapters/support/v2", "rank": 8}
SQL = {"name": "acme/sql", "uri": "hf://acme/sql-lora@v3"}
LOCAL = {"name": "baked-in", "uri": "/opt/adapters/baked"}


def model(**spec):
    return load_model(minimal(**spec))


def template(m):
    return desired_deployment(m)["spec"]["template"]


def adapters_file(m) -> list[dict]:
    cm = desired_adapter_config_map(m)
    return json.loads(cm["data"]["adapters.json"])["adapters"]


def test_no_lora_no_flags_no_configmap_no_volume():
    m = model()
    assert lora_args(m) == [] and "--enable-lora" not in server_args(m)
    assert desired_adapter_config_map(m) is None
    assert desired_children(m)["ConfigMap"] is None
    names = [v["name"] for v in template(m)["spec"]["volumes"]]
    assert "adapters" not in names


def test_adapters_turn_lora_on_with_default_limits():
    args = server_args(model(adapters=[SUPPORT]))
    i = args.index("--adapters-file")
    assert args[i : i + 6] == [
        "--adapters-file", "/etc/sluice/adapters/adapters.json",
        "--max-loras", "4", "--max-lora-rank", "16",
    ]  # fmt: skip
    assert "--max-cpu-loras" not in args
    assert args.index("--adapters-file") < args.index("--protocols")  # before the -- section


def test_engine_lora_alone_turns_lora_on_and_sets_every_limit():
    m = model(engine={"lora": {"maxLoras": 2, "maxLoraRank": 64, "maxCpuLoras": 8}})
    assert lora_args(m)[2:] == [
        "--max-loras", "2", "--max-lora-rank", "64", "--max-cpu-loras", "8"
    ]  # fmt: skip
    assert adapters_file(m) == []  # an empty list: pods start with LoRA on and no adapter


def test_configmap_lists_each_adapter_with_its_pod_path_and_id():
    m = model(adapters=[SUPPORT, SQL, LOCAL])
    cm = desired_adapter_config_map(m)
    kubernetes_validate.validate(cm, "1.35", strict=True)
    assert cm["metadata"]["name"] == "m-adapters"
    assert cm["metadata"]["labels"]["app.kubernetes.io/instance"] == "m"
    entries = adapters_file(m)
    assert [e["name"] for e in entries] == ["support-v2", "acme/sql", "baked-in"]
    assert entries[0]["uri"] == "/mnt/adapters/adapters/support/v2"  # pvc:// -> its mount
    assert entries[0]["rank"] == 8 and "rank" not in entries[1]
    assert entries[1]["uri"] == "hf://acme/sql-lora@v3"  # downloaded by the pod
    assert entries[2]["uri"] == "/opt/adapters/baked"
    ids = {e["id"] for e in entries}
    assert len(ids) == 3 and all(len(i) == 16 for i in ids)


def test_an_adapter_id_changes_with_its_source_not_with_its_rank():
    spec = load_model(minimal(adapters=[SUPPORT])).spec.adapters[0]
    moved = spec.model_copy(update={"uri": "pvc://adapters/support/v3"})
    reranked = spec.model_copy(update={"rank": 16})
    assert adapter_id(moved) != adapter_id(spec) == adapter_id(reranked)


def test_configmap_is_mounted_whole_and_read_only():
    t = template(model(adapters=[SUPPORT]))
    vol = next(v for v in t["spec"]["volumes"] if v["name"] == "adapters")
    assert vol["configMap"] == {
        "name": "m-adapters",
        "items": [{"key": "adapters.json", "path": "adapters.json"}],
    }
    (mount,) = [m for m in t["spec"]["containers"][0]["volumeMounts"] if m["name"] == "adapters"]
    # No subPath: a subPath mount never sees the kubelet's updates of the ConfigMap.
    assert mount == {"name": "adapters", "mountPath": "/etc/sluice/adapters", "readOnly": True}


def test_pvc_adapter_claims_are_mounted_once_each():
    two = dict(SUPPORT, name="support-v3", uri="pvc://adapters/support/v3")
    other = dict(SUPPORT, name="legal", uri="pvc://legal-claim/lora")
    t = template(model(adapters=[SUPPORT, two, other]))
    claims = [v["persistentVolumeClaim"] for v in t["spec"]["volumes"]
              if v["name"].startswith("adapter-pvc-")]  # fmt: skip
    assert claims == [
        {"claimName": "adapters", "readOnly": True},
        {"claimName": "legal-claim", "readOnly": True},
    ]
    mounts = {m["mountPath"] for m in t["spec"]["containers"][0]["volumeMounts"]}
    assert {"/mnt/adapters/adapters", "/mnt/adapters/legal-claim"} <= mounts


LORA_ON = {"lora": {}}


@pytest.mark.parametrize(
    "before,after",
    [
        ([], [SQL]),  # the first adapter, engine.lora already set
        ([SUPPORT], [SUPPORT, SQL]),  # added
        ([SUPPORT, SQL], [SUPPORT]),  # removed
        ([SUPPORT], [SUPPORT, dict(SUPPORT, name="support-v3", uri="pvc://adapters/v3")]),
        ([SUPPORT], [dict(SUPPORT, uri="pvc://adapters/support/v3")]),  # same claim, new path
        ([SUPPORT], [dict(SUPPORT, rank=16)]),
        ([SQL], [dict(SQL, uri="hf://acme/sql-lora@v4")]),
        ([SUPPORT, SQL, LOCAL], [LOCAL, SUPPORT, SQL]),  # reordered
    ],
)
def test_adapter_changes_leave_the_pod_template_alone(before, after):
    """No rollout: the Deployment (so its pod template) is the same, the ConfigMap is not."""
    a = model(engine=LORA_ON, adapters=before)
    b = model(engine=LORA_ON, adapters=after)
    assert desired_deployment(a) == desired_deployment(b)
    assert desired_adapter_config_map(a) != desired_adapter_config_map(b)


@pytest.mark.parametrize(
    "before,after",
    [
        ({}, {"adapters": [SUPPORT]}),  # LoRA on for the first time
        ({"engine": LORA_ON}, {}),  # off again
        ({"engine": LORA_ON}, {"engine": {"lora": {"maxLoras": 8}}}),
        ({"engine": LORA_ON}, {"engine": {"lora": {"maxLoraRank": 32}}}),
        ({"engine": LORA_ON}, {"engine": {"lora": {"maxCpuLoras": 16}}}),
        # A claim no adapter used before is a new volume (and one no adapter uses any more
        # is dropped): documented on adapters[].uri.
        ({"adapters": [SUPPORT]}, {"adapters": [dict(SUPPORT, uri="pvc://other/x")]}),
        ({"engine": LORA_ON}, {"engine": LORA_ON, "adapters": [SUPPORT]}),
    ],
)
def test_engine_start_settings_and_new_claims_change_the_pod_template(before, after):
    assert template(model(**before)) != template(model(**after))


def test_the_configmap_is_applied_before_the_pods_that_mount_it():
    assert CHILD_KINDS.index(ADAPTER_CONFIG_MAP) < CHILD_KINDS.index(DEPLOYMENT)
    assert ADAPTER_CONFIG_MAP.child_name("m") == "m-adapters"
    assert ADAPTER_CONFIG_MAP.owner_of("m-adapters") == "m"


@pytest.mark.parametrize(
    "flag",
    ["--enable-lora", "--max-loras=2", "--max-lora-rank", "--max_cpu_loras", "--lora-modules",
     "--no-enable-lora", "--adapters-file"],
)  # fmt: skip
def test_lora_flags_cannot_come_through_extra_args(flag):
    with pytest.raises(SpecError, match="must not repeat flags the operator sets from the spec"):
        model(engine={"extraArgs": [flag, "1"]})
