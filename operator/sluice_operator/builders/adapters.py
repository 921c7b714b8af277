"""LoRA adapters: the ConfigMap with the adapter list, and what the pod needs to read it.

Adapters change without a restart, so their list is kept out of the pod template: the
operator writes it to the ConfigMap `<name>-adapters` (key `adapters.json`), mounted as a
whole volume (no subPath, so the kubelet's updates reach running pods), and each server
process watches the file and loads or unloads adapters in its engine. The template only
holds what is fixed while the engine runs: the LoRA limits (`--max-loras`...), the file's
path, and one read-only volume per PersistentVolumeClaim that pvc:// adapters live on.

Each entry carries an `id`: a digest of the adapter's name and spec uri. The server derives
vLLM's integer LoRA id from it, so every API worker of a pod addresses the same adapter with
the same id, and reports each adapter's state under it (`sluice_adapter_state`), so the
operator can tell a pod that serves the current adapter from one still on an older list.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ..models.adapters import AdapterSpec
from ..models.resource import ADAPTER_PVC_DIR, ADAPTERS_DIR, ADAPTERS_FILE, StreamingModel
from .common import fmt_number, metadata

ADAPTERS_SUFFIX = "-adapters"


def adapter_config_map_name(model: StreamingModel) -> str:
    return model.name + ADAPTERS_SUFFIX


def adapter_id(adapter: AdapterSpec) -> str:
    """What the operator and every pod call this adapter (name and source: a new uri under
    the same name is another adapter)."""
    return hashlib.sha256(f"{adapter.name}\0{adapter.uri}".encode()).hexdigest()[:16]


def _claim(uri: str) -> tuple[str, str] | None:
    if not uri.startswith("pvc://"):
        return None
    claim, _, path = uri.removeprefix("pvc://").partition("/")
    return claim, path


def adapter_claims(model: StreamingModel) -> list[str]:
    """The claims pvc:// adapters live on, each mounted once (read-only)."""
    return sorted({c[0] for a in model.spec.adapters if (c := _claim(a.uri))})


def pod_uri(uri: str) -> str:
    """Where the server finds the adapter: a pvc:// uri becomes its path in the pod."""
    c = _claim(uri)
    return f"{ADAPTER_PVC_DIR}/{c[0]}/{c[1]}".rstrip("/") if c else uri


def adapter_entries(model: StreamingModel) -> list[dict[str, Any]]:
    out = []
    for a in model.spec.adapters:
        entry: dict[str, Any] = {"name": a.name, "uri": pod_uri(a.uri), "id": adapter_id(a)}
        if a.rank is not None:
            entry["rank"] = a.rank
        out.append(entry)
    return out


def desired_adapter_config_map(model: StreamingModel) -> dict[str, Any] | None:
    if not model.spec.lora_enabled:
        return None
    text = json.dumps({"adapters": adapter_entries(model)}, indent=1, sort_keys=True)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(model, name=adapter_config_map_name(model)),
        "data": {ADAPTERS_FILE: text + "\n"},
    }


def lora_args(model: StreamingModel) -> list[str]:
    """The server flags that start the engine with LoRA on (engine-start settings only)."""
    if not model.spec.lora_enabled:
        return []
    limits = model.spec.lora_limits
    args = ["--adapters-file", f"{ADAPTERS_DIR}/{ADAPTERS_FILE}"]
    args += ["--max-loras", str(limits.max_loras), "--max-lora-rank", str(limits.max_lora_rank)]
    if limits.max_cpu_loras is not None:
        args += ["--max-cpu-loras", fmt_number(limits.max_cpu_loras)]
    return args


def adapter_volumes(model: StreamingModel) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    if not model.spec.lora_enabled:
        return [], []
    volumes: list[dict[str, Any]] = [
        {
            "name": "adapters",
            "configMap": {
                "name": adapter_config_map_name(model),
                "items": [{"key": ADAPTERS_FILE, "path": ADAPTERS_FILE}],
            },
        }
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "adapters", "mountPath": ADAPTERS_DIR, "readOnly": True}
    ]
    for i, claim in enumerate(adapter_claims(model)):
        name = f"adapter-pvc-{i}"
        volumes.append(
            {"name": name, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
        )
        mounts.append({"name": name, "mountPath": f"{ADAPTER_PVC_DIR}/{claim}", "readOnly": True})
    return volumes, mounts
