"""The KV-cache events a router model's pods publish for the router (spec.routing.router).

vLLM publishes what enters and leaves each pod's prefix cache (`BlockStored`,
`BlockRemoved`, `AllBlocksCleared`) as msgpack batches on a ZMQ PUB socket
(`--kv-events-config`, vllm/distributed/kv_events.py), and answers catch-up requests on a
ZMQ ROUTER socket (`replay_endpoint`, the last `buffer_steps` batches). The router
subscribes to every Ready pod of the model at its pod IP (from its Pod watch) and so knows
which prompt blocks each pod holds.

Both endpoints bind every interface of the pod (`tcp://*:PORT`): vLLM binds the PUB endpoint
only when it holds `*` or `::` and *connects* to any other address, so
`tcp://<pod IP>:PORT` would publish to nowhere. Each pod has its own network namespace, so
the fixed ports never collide (the e2e node agent, whose pods share the host's, maps the
wildcard to the pod's own address as it does for the server's `--host 0.0.0.0`).

`--enable-prefix-caching` (vLLM's default, stated so that the model's flags say it) comes
first after `--`, before `engine.extraArgs`, which win as everywhere. The block hash is
vLLM's default (`sha256`, seeded with the fixed `vllm-none-hash` while PYTHONHASHSEED is
unset). The router reads the engine's block size, hash and seed from the pod itself
(`--describe-prefix-cache`, builders/args.py), so the operator sets no PYTHONHASHSEED (which
would also turn off Python's hash randomization in the server).

The events carry prompt token ids in clear and the ports take no credentials: the model's
NetworkPolicy, or while that is off a policy of their own (builders/networkpolicy.py), opens
them to the router's pods only.

Models that do not opt in get none of this: their pod templates are unchanged.
"""

from __future__ import annotations

import json
from typing import Any

from ..models.resource import StreamingModel

KV_EVENTS_PORT = 5557
KV_REPLAY_PORT = 5558
# Labels of the router's (the chart's activator's) pods, whatever the release's name.
ROUTER_POD_LABELS = {
    "app.kubernetes.io/name": "sluice-activator",
    "app.kubernetes.io/component": "activator",
}


def kv_events_config() -> dict[str, Any]:
    """vLLM's `--kv-events-config` (vllm/config/kv_events.py: KVEventsConfig)."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{KV_EVENTS_PORT}",
        "replay_endpoint": f"tcp://*:{KV_REPLAY_PORT}",
    }


def kv_event_args(model: StreamingModel) -> list[str]:
    """vLLM engine arguments (after `--`) of a router model's server; none otherwise, and
    none on the simulator (which takes no vLLM arguments)."""
    if not model.routed or model.simulated:
        return []
    config = json.dumps(kv_events_config(), sort_keys=True, separators=(",", ":"))
    return ["--enable-prefix-caching", "--kv-events-config", config]


def kv_event_ports(model: StreamingModel) -> list[dict[str, Any]]:
    """The container ports of the events (named, so `kubectl describe` shows them)."""
    if not kv_event_args(model):
        return []
    return [
        {"name": "kv-events", "containerPort": KV_EVENTS_PORT, "protocol": "TCP"},
        {"name": "kv-replay", "containerPort": KV_REPLAY_PORT, "protocol": "TCP"},
    ]
