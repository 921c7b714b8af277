"""Golden pod templates: what every model's pods get, checked in, so a change is a decision.

A new operator release that renders a different pod template for an unchanged
StreamingModel restarts that model's pods (a new ReplicaSet), and with it every model of
the fleet at once. So each sample in `samples/` and each spec in `COMBINATIONS` is rendered
through the operator's pure builders, and its Deployment's `spec.template` is compared with
`tests/operator/golden/<case>.yaml`. A builder change that changes what pods get fails here
with the diff until the golden files are regenerated in the same commit:

    make golden        # = SLUICE_UPDATE_GOLDEN=1 python -m pytest tests/operator/test_operator_golden.py

The diff of the golden files is then what reviewers read ("every model gets a new probe"),
and docs/helm.md says how such a release is rolled out (`operator.maxConcurrentModelRollouts`).
"""

from __future__ import annotations

import copy
import difflib
import os
import re
from pathlib import Path

import pytest
import sluice_operator
import yaml
from operator_helpers import SAMPLES
from sluice_operator.models.resource import OperatorDefaults
from sluice_operator.models.spec import FORMER_DEFAULT_IMAGE
from sluice_operator.render import render_objects
from sluice_operator.validation import load_model
from sluice_operator.yamldump import dump_yaml
from testkit.repo import ROOT

GOLDEN = Path(__file__).parent / "golden"
# The operator as the chart runs it: with the router's master continuation key, so router
# models' pods mount their key (builders/continuation.py). Its value never reaches a pod
# template.
OPERATOR = OperatorDefaults(continuation_key=b"golden-master-key")
UPDATE = os.environ.get("SLUICE_UPDATE_GOLDEN") == "1"
REGENERATE = "make golden"

BASE = {"model": {"uri": "hf://org/model"}}
# Spec fields that reach the pod template, in combinations the samples do not cover. Each
# entry is merged into BASE (dicts deeply); names become file names.
COMBINATIONS: dict[str, dict] = {
    "defaults": {},
    "pvc-weights-and-cache": {
        "model": {"uri": "pvc://weights/llama/3.1-8b", "cache": {"pvcName": "hf-cache"}},
    },
    "secrets-everywhere": {
        "model": {"hfTokenSecretRef": {"name": "hf", "key": "token"}},
        "auth": {
            "apiKeySecretRef": {"name": "keys"},
            "jwt": {
                "issuer": "https://login.example.com",
                "audience": "m",
                "jwks": {"secretRef": {"name": "jwks"}},
            },
            "rateLimit": {
                "requestsPerMinute": 10,
                "backend": "redis",
                "redisUrlSecretRef": {"name": "redis"},
            },
        },
    },
    "placement-and-identity": {
        "resources": {
            "nodeSelector": {"pool": "h100"},
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
            ],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": "zone", "operator": "In", "values": ["a"]}
                                ]
                            }
                        ]
                    }
                }
            },
            "priorityClassName": "inference",
        },
        "serviceAccountName": "model-runner",
        "image": "registry.example.com/sluice-server:pinned",
        "imagePullPolicy": "Always",
        "imagePullSecrets": [{"name": "registry"}],
    },
    "pod-metadata": {
        "podLabels": {"team": "search", "app.kubernetes.io/instance": "not-mine"},
        "podAnnotations": {"sidecar.istio.io/inject": "false", "prometheus.io/port": "1"},
    },
    "engine-tuned": {
        "engine": {
            "maxModelLen": 32768,
            "maxNumSeqs": 128,
            "maxNumBatchedTokens": 8192,
            "gpuMemoryUtilization": 0.85,
            "swapSpaceGiB": 4,
            "dtype": "bfloat16",
            "quantization": "fp8",
            "extraArgs": ["--enable-prefix-caching"],
            "env": [
                {"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"},
                {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            ],
        },
    },
    "tp2-pp2-with-cpu-and-memory": {
        "resources": {
            "gpus": 4,
            "requests": {"cpu": "8", "memory": "64Gi"},
            "limits": {"memory": "96Gi"},
            "sharedMemorySize": "16Gi",
        },
        "parallelism": {"tensor": 2, "pipeline": 2},
    },
    "streaming-all-protocols": {
        "streaming": {
            "protocols": ["sse", "websocket", "responses", "anthropic"],
            "heartbeatSeconds": 5,
            "maxConcurrentStreams": 64,
            "cors": {"allowedOrigins": ["https://app.example.com"]},
            "resume": {"graceSeconds": 30},
            "playground": False,
        },
        "limits": {"maxRequestBytes": 1048576},
    },
    "workers-startup-in-place-rollout": {
        "server": {"apiWorkers": 4},
        "startup": {"timeoutSeconds": 3600},
        "rollout": {"maxSurge": 0, "maxUnavailable": 1},
    },
    "autoscaled-with-tracing": {
        "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4},
        "observability": {
            "tracing": {"endpoint": "http://otel-collector:4317", "sampleRatio": 0.1}
        },
    },
    "simulator": {"engine": {"backend": "simulator"}, "resources": {"gpus": 1}},
    "two-nodes-tp8-pp2": {
        "resources": {"gpus": 8},
        "parallelism": {"tensor": 8, "pipeline": 2, "nodes": 2},
    },
    # The router on a group: the continuation key is mounted on the leader (which serves
    # the streams), never on the workers.
    "router-two-nodes": {
        "resources": {"gpus": 8},
        "parallelism": {"tensor": 8, "pipeline": 2, "nodes": 2},
        "routing": {"router": {"enabled": True}},
    },
    # Migration off: the router places requests, and the pods get no key.
    "router-without-migration": {
        "routing": {"router": {"enabled": True, "migration": {"enabled": False}}},
    },
    # LoRA on a group: the adapter list is mounted on the leader, whose engine loads them.
    "lora-two-nodes": {
        "resources": {"gpus": 8},
        "parallelism": {"tensor": 8, "pipeline": 2, "nodes": 2},
        "engine": {"lora": {"maxLoras": 2, "maxLoraRank": 16}},
        "adapters": [{"name": "support", "uri": "pvc://adapters/support", "rank": 16}],
    },
    # Disaggregated on the CPU path: the shared-storage connector's claim on both pools, no
    # side channel (that is NIXL's); the GPU path with NIXL is samples/disaggregated.yaml.
    "disaggregated-shared-storage-simulator": {
        "engine": {"backend": "simulator"},
        "routing": {"router": {"enabled": True}},
        "disaggregation": {
            "connector": {"type": "sharedStorage", "sharedStorage": {"claimName": "kv-share"}},
            "decode": {"replicas": 2},
        },
    },
}


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _combination(spec: dict) -> dict:
    return {
        "apiVersion": "serving.sluice.dev/v1alpha1",
        "kind": "StreamingModel",
        "metadata": {"name": "m", "namespace": "default"},
        "spec": _merge(BASE, spec),
    }


def _samples() -> dict[str, dict]:
    out = {}
    for path in SAMPLES:
        for body in yaml.safe_load_all(path.read_text()):
            if body and body.get("kind") == "StreamingModel":
                out[f"sample-{path.stem}-{body['metadata']['name']}"] = body
    return out


CASES: dict[str, dict] = {
    **_samples(),
    **{f"spec-{name}": _combination(spec) for name, spec in COMBINATIONS.items()},
}


def pod_template(body: dict, defaults: OperatorDefaults = OPERATOR) -> dict:
    """The pod template of the model's Deployment, as the operator renders it; for a model
    on several nodes, its LeaderWorkerSet's leader and worker templates; for a disaggregated
    one, its prefill and decode Deployments' templates."""
    workloads = [
        m
        for m in render_objects(copy.deepcopy(body), defaults=defaults)
        if m["kind"] in ("Deployment", "LeaderWorkerSet")
    ]
    if len(workloads) == 2:
        roles = {w["metadata"]["labels"]["serving.sluice.dev/role"]: w for w in workloads}
        return {f"{r}Template": roles[r]["spec"]["template"] for r in ("prefill", "decode")}
    (workload,) = workloads
    if workload["kind"] == "LeaderWorkerSet":
        group = workload["spec"]["leaderWorkerTemplate"]
        return {k: group[k] for k in ("leaderTemplate", "workerTemplate")}
    return workload["spec"]["template"]


def _golden_text(name: str, body: dict) -> str:
    header = (
        f"# Pod template the operator renders for {name} (tests/operator/test_operator_golden.py).\n"
        f"# Regenerate with `{REGENERATE}` when a change to what pods get is intended.\n"
    )
    return header + dump_yaml(pod_template(body))


@pytest.mark.parametrize("name", sorted(CASES))
def test_pod_template_matches_its_golden_file(name):
    path = GOLDEN / f"{name}.yaml"
    want = _golden_text(name, CASES[name])
    if UPDATE:
        GOLDEN.mkdir(exist_ok=True)
        if not path.exists() or path.read_text() != want:
            path.write_text(want)
        return
    assert path.exists(), f"no golden file {path.relative_to(ROOT)}: run `{REGENERATE}`"
    have = path.read_text()
    if have != want:
        diff = "".join(
            difflib.unified_diff(
                have.splitlines(keepends=True),
                want.splitlines(keepends=True),
                fromfile=f"{path.relative_to(ROOT)} (checked in)",
                tofile="rendered now",
            )
        )
        pytest.fail(
            f"the pod template of {name} changed: every model like it would restart on "
            f"upgrade. If intended, run `{REGENERATE}` and commit the golden files with the "
            f"change (docs/helm.md, 'Upgrades').\n{diff}",
            pytrace=False,
        )


UNSET_IMAGE = sorted(n for n, body in CASES.items() if "image" not in body["spec"])


@pytest.mark.parametrize("name", UNSET_IMAGE)
def test_a_stored_former_default_image_renders_the_golden_file(name):
    """Objects created while the CRD defaulted spec.image hold FORMER_DEFAULT_IMAGE; each
    model without spec.image, rendered with that value stored, gets exactly its golden pod
    template: no model rolls when the operator stops the CRD default."""
    if UPDATE:
        return
    body = copy.deepcopy(CASES[name])
    body["spec"]["image"] = FORMER_DEFAULT_IMAGE
    assert _golden_text(name, body) == (GOLDEN / f"{name}.yaml").read_text()


def test_every_golden_file_belongs_to_a_case():
    """A golden file whose case was renamed or removed would silently stop guarding."""
    if UPDATE:
        for path in GOLDEN.glob("*.yaml"):
            if path.stem not in CASES:
                path.unlink()
        return
    orphans = sorted(p.name for p in GOLDEN.glob("*.yaml") if p.stem not in CASES)
    assert not orphans, f"golden files without a case: {orphans} (run `{REGENERATE}`)"


def _migrates(body: dict) -> bool:
    router = body["spec"].get("routing", {}).get("router", {})
    return bool(router.get("enabled")) and router.get("migration", {}).get("enabled", True)


@pytest.mark.parametrize("name", sorted(CASES))
def test_only_router_models_pods_change_with_the_continuation_key(name):
    """The operator's master key (the chart gives it one with the router) reaches only the
    pods of models that use the router: every other model's pods are what an operator
    without the key renders, so turning migration on restarts no other model. The router
    models differ by the key's volume, its mount and `--continuation-key-file` only."""
    body = CASES[name]
    keyless, keyed = pod_template(body, OperatorDefaults()), pod_template(body)
    if "workerTemplate" in keyed:  # a group: the workers never get the key
        assert keyed["workerTemplate"] == keyless["workerTemplate"]
        keyed, keyless = keyed["leaderTemplate"], keyless["leaderTemplate"]
    if "decodeTemplate" in keyed:  # two pools: both serve streams, both get the key
        for pool in ("prefillTemplate", "decodeTemplate"):
            _differ_by_the_key_only(body, keyed[pool], keyless[pool])
        return
    _differ_by_the_key_only(body, keyed, keyless)


def _differ_by_the_key_only(body: dict, keyed: dict, keyless: dict) -> None:
    if not _migrates(body):
        assert keyed == keyless
        return
    pod, plain = keyed["spec"], keyless["spec"]
    (c,), (p,) = pod["containers"], plain["containers"]
    flag = c["args"].index("--continuation-key-file")
    assert c["args"][flag + 1] == "/etc/sluice/continuation/key"
    assert c["args"][:flag] + c["args"][flag + 2 :] == p["args"]
    assert "--" not in c["args"][:flag]  # a server flag, not one of vLLM's after `--`
    mount = {"name": "continuation-key", "mountPath": "/etc/sluice/continuation", "readOnly": True}
    assert c["volumeMounts"] == [*p["volumeMounts"], mount]
    assert pod["volumes"] == [*plain["volumes"], {"name": "continuation-key", "secret": {
        "secretName": f"{body['metadata']['name']}-continuation-key",
        "items": [{"key": "key", "path": "key"}], "defaultMode": 0o440,
        "optional": True}}]  # fmt: skip
    rest = lambda t: {k: v for k, v in t.items() if k != "spec"}  # noqa: E731
    assert rest(keyed) == rest(keyless)
    assert {k: v for k, v in pod.items() if k not in ("containers", "volumes")} == {
        k: v for k, v in plain.items() if k not in ("containers", "volumes")}  # fmt: skip


def test_the_golden_comparison_has_teeth():
    """Negative control: a one-character change in what pods get is a mismatch."""
    name = "spec-defaults"
    body = copy.deepcopy(CASES[name])
    body["spec"]["podAnnotations"] = {"x": "y"}
    assert _golden_text(name, body) != (GOLDEN / f"{name}.yaml").read_text()


VERSION_WORDS = re.compile(r"version|release|revision|build", re.IGNORECASE)


@pytest.mark.parametrize("name", sorted(CASES))
def test_pod_template_does_not_follow_the_operator_version(name, monkeypatch):
    """Rendered with two operator version strings, every pod template is the same, and no
    pod label or annotation is named after a version (`app.kubernetes.io/version` on pods
    would restart every model on every release)."""
    body = CASES[name]
    templates = []
    for version in ("0.1.0", "99.0.0-rc.1+build.7"):
        monkeypatch.setattr(sluice_operator, "__version__", version)
        templates.append(pod_template(body))
    assert templates[0] == templates[1]
    pods = [
        templates[0][k]
        for k in ("leaderTemplate", "workerTemplate", "prefillTemplate", "decodeTemplate")
        if k in templates[0]
    ]
    named = [
        k
        for meta in [p["metadata"] for p in pods or [templates[0]]]
        for k in {**meta.get("labels", {}), **meta.get("annotations", {})}
        if VERSION_WORDS.search(k)
    ]
    own = [k for k in named if k not in (body["spec"].get("podLabels") or {})
           and k not in (body["spec"].get("podAnnotations") or {})]  # fmt: skip
    assert not own, f"version-like pod metadata keys: {own}"
    assert sluice_operator.__version__ not in dump_yaml(templates[1])


def test_builders_never_read_the_operator_version():
    """The version string is for logs and the user agent: no builder imports it."""
    builders = ROOT / "operator" / "sluice_operator" / "builders"
    for path in [*builders.glob("*.py"), ROOT / "operator/sluice_operator/kinds.py"]:
        text = path.read_text()
        assert "__version__" not in text and "importlib.metadata" not in text, path.name


def test_version_independence_check_has_teeth(monkeypatch):
    """Negative control: a builder that stamps the version on pods is caught."""
    import sluice_operator.kinds as kinds

    real = kinds.desired_children

    def stamping(model):
        out = real(model)
        meta = out["Deployment"]["spec"]["template"]["metadata"]
        meta["annotations"]["sluice.dev/operator-version"] = sluice_operator.__version__
        return out

    monkeypatch.setattr("sluice_operator.render.desired_children", stamping)
    body = CASES["spec-defaults"]
    seen = []
    for version in ("0.1.0", "0.2.0"):
        monkeypatch.setattr(sluice_operator, "__version__", version)
        seen.append(pod_template(body))
    assert seen[0] != seen[1]


def test_cases_are_valid_models():
    for name, body in CASES.items():
        load_model(copy.deepcopy(body))  # raises SpecError naming the field
        assert name == re.sub(r"[^a-z0-9.-]", "-", name)
