"""What a disaggregated model's pods get (spec.disaggregation, models/disaggregation.py).

Both pools run the same server with `--disaggregation-role prefill|decode` and
`--kv-transfer-config '<json>'`, vLLM's KVTransferConfig, which the server hands to the
engine (and the simulator accepts):

- nixl: `{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}` on prefill pods and
  `"kv_consumer"` on decode pods (vLLM deprecates `kv_both` with NIXL and says it will
  refuse it). A decode pod asks the
  prefill pod named in the request's `kv_transfer_params` (remote_host, remote_port) for the
  blocks over NIXL's side channel: vLLM listens on VLLM_NIXL_SIDE_CHANNEL_PORT (5600, plus the
  data-parallel rank, which is 0 here) at VLLM_NIXL_SIDE_CHANNEL_HOST, which must be an
  address other pods reach (its default is localhost): the pod's IP, from the downward API.
  The port is a named container port, and the NetworkPolicies (builders/networkpolicy.py)
  open it to the model's two pools only.
- sharedStorage: `{"kv_connector": "ExampleConnector", "kv_role": "kv_both",
  "kv_connector_extra_config": {"shared_storage_path": "/mnt/kv-transfer"}}` with the
  ReadWriteMany claim of connector.sharedStorage mounted there read-write on both pools.

Models without spec.disaggregation get none of this: their pod templates are unchanged.
"""

from __future__ import annotations

import json
from typing import Any

from ..models.resource import StreamingModel

SIDE_CHANNEL_PORT = 5600
SIDE_CHANNEL_PORT_NAME = "nixl-side"
SHARED_KV_DIR = "/mnt/kv-transfer"
SHARED_KV_VOLUME = "kv-transfer"
POOL_SUFFIX = {"prefill": "-prefill", "decode": "-decode"}


def kv_transfer_config(model: StreamingModel) -> dict[str, Any]:
    """vLLM's `--kv-transfer-config` of both pools (vllm/config/kv_transfer.py)."""
    d = model.spec.disaggregation
    assert d is not None
    if d.connector.type == "nixl":
        role = {"prefill": "kv_producer", "decode": "kv_consumer"}.get(model.role or "", "kv_both")
        return {"kv_connector": "NixlConnector", "kv_role": role}
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": SHARED_KV_DIR},
    }


def uses_nixl(model: StreamingModel) -> bool:
    d = model.spec.disaggregation
    return d is not None and d.connector.type == "nixl"


def disaggregation_args(model: StreamingModel) -> list[str]:
    """The server flags of a pool's pods; none for a model as a whole."""
    if model.role is None:
        return []
    config = json.dumps(kv_transfer_config(model), sort_keys=True, separators=(",", ":"))
    return ["--disaggregation-role", model.role, "--kv-transfer-config", config]


def side_channel_env(model: StreamingModel) -> list[dict[str, Any]]:
    if model.role is None or not uses_nixl(model):
        return []
    return [
        {
            "name": "VLLM_NIXL_SIDE_CHANNEL_HOST",
            "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
        },
        {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": str(SIDE_CHANNEL_PORT)},
    ]


def side_channel_ports(model: StreamingModel) -> list[dict[str, Any]]:
    """The container port of the side channel (a pool's pods with NIXL)."""
    if model.role is None or not uses_nixl(model):
        return []
    return [{"name": SIDE_CHANNEL_PORT_NAME, "containerPort": SIDE_CHANNEL_PORT, "protocol": "TCP"}]


def model_side_ports(model: StreamingModel) -> list[int]:
    """The side-channel ports of the model's pods (for its NetworkPolicies)."""
    return [SIDE_CHANNEL_PORT] if uses_nixl(model) else []


def shared_kv_volumes(model: StreamingModel) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    d = model.spec.disaggregation
    if model.role is None or d is None or d.connector.shared_storage is None:
        return [], []
    claim = d.connector.shared_storage.claim_name
    return (
        [{"name": SHARED_KV_VOLUME, "persistentVolumeClaim": {"claimName": claim}}],
        [{"name": SHARED_KV_VOLUME, "mountPath": SHARED_KV_DIR}],
    )


def pool_name(model: StreamingModel) -> str:
    """A pool's Deployment (and autoscaler): `<name>-prefill`, `<name>-decode`."""
    assert model.role is not None
    return model.name + POOL_SUFFIX[model.role]
