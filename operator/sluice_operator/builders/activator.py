"""The router and scale to zero: how a model's route reaches the operator's activator, and
what it knows.

The activator (the server image in activator (router) mode, shipped by the sluice-operator
chart as Deployment and Service `<release>-activator` in the operator's namespace) holds a
model's requests while the model has no Ready replica, and forwards them once one is. For a
model that opts into the router (spec.routing.router) it is the route's backend at every
replica count: it watches the model's pods and places each request on a Ready one.

- The route names a Service in the model's own namespace (an Ingress can name no other):
  `<name>-activator`, of type ExternalName, pointing at the activator Service's FQDN. An
  ExternalName Service is a DNS CNAME: no EndpointSlice to keep, no selector, and
  ingress-nginx accepts it as a backend. The same Service serves an HTTPRoute (a
  ReferenceGrant would also do there; one path is simpler to keep right). It exists while
  autoscaling.minReplicas is 0 or the model opts into the router (`in_activator`).
- The activator tells models apart by the request's Host: the route rewrites it to the
  model Service's FQDN (`upstream_host`), which is also where the activator forwards.
- The operator keeps ONE ConfigMap in its own namespace, `<activator>-models`, key
  `models.json`: an entry per model with minReplicas 0 or the router (`activator_entry`). It
  is the activator's allowlist: a Host it does not list is answered 404, never proxied. A
  router model's entry also says which pods to watch (`pods`: namespace, the Service's
  selector, so a multi-node group's leaders only, and the port) and how to place requests
  on them (`balance`: spec.routing.balance, which the router applies itself: the route has
  one backend); without `pods` the activator forwards to the Service `host`. A router model
  whose streams migrate (builders/continuation.py) also has `migration`: how many times a
  stream may move (`maxMigrations`) and how long a silent upstream is taken for a broken one
  (`stallSeconds`). The owner of a split (builders/split.py) has `split`: every version
  with the weight the router applies, the owner first.

Pure: the model in, manifests out.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from ..models.resource import StreamingModel, pool_view
from ..models.scaling import ScaleToZeroSpec
from .common import (
    MANAGED_BY_LABEL,
    MANAGER,
    PORT,
    PORT_NAME,
    metadata,
    selector_labels,
    serving_pods,
)
from .continuation import migration_entry
from .kvevents import KV_EVENTS_PORT, KV_REPLAY_PORT, kv_event_args
from .leaderworkerset import leader_selector
from .split import check_versions, split_entry

ACTIVATOR_SUFFIX = "-activator"
MODELS_FILE = "models.json"
CONFIG_MAP_SUFFIX = "-models"
# How often the activator writes a keep-alive to a held stream (proxies cut idle
# connections after 60 s or so; the bound is 15 s).
KEEPALIVE_SECONDS = 10
# The ingress-nginx annotation that sets the Host header sent upstream.
UPSTREAM_VHOST = "nginx.ingress.kubernetes.io/upstream-vhost"


def activator_service_name(model: StreamingModel) -> str:
    return model.name + ACTIVATOR_SUFFIX


def upstream_host(model: StreamingModel) -> str:
    """The model Service's FQDN: the Host the route sends to the activator, and where the
    activator forwards."""
    return f"{model.name}.{model.namespace}.svc.cluster.local"


def model_key(model: StreamingModel) -> str:
    """The entry's key in models.json, and the activator's `X-Sluice-Model` header value."""
    return f"{model.namespace}/{model.name}"


def in_activator(model: StreamingModel) -> bool:
    """The activator knows the model: minReplicas 0, or the model opts into the router."""
    return model.spec.scale_to_zero is not None or model.routed


def desired_activator_service(model: StreamingModel) -> dict[str, Any] | None:
    """`<name>-activator`: ExternalName to the activator; with minReplicas 0 or the router."""
    if not in_activator(model):
        return None
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            **metadata(model),
            "name": activator_service_name(model),
            "labels": {**metadata(model)["labels"], "app.kubernetes.io/component": "activator"},
        },
        "spec": {
            "type": "ExternalName",
            "externalName": model.activator_host,
            "ports": [
                {
                    "name": PORT_NAME,
                    "port": PORT,
                    "targetPort": PORT,
                    "protocol": "TCP",
                    "appProtocol": "http",
                }
            ],
        },
    }


def router_pods(model: StreamingModel) -> dict[str, Any]:
    """The pods the router watches for a model: the model Service's selector (a multi-node
    group's leaders, which alone serve HTTP) in the model's namespace, their port, and
    where they publish their KV-cache events when they do (builders/kvevents.py: a router
    model on vLLM; the simulator publishes none)."""
    pods: dict[str, Any] = {
        "namespace": model.namespace,
        "selector": {**selector_labels(model), **leader_selector(model), **serving_pods(model)},
        "port": PORT,
    }
    if kv_event_args(model):
        pods["kvEvents"] = {"port": KV_EVENTS_PORT, "replayPort": KV_REPLAY_PORT}
    return pods


def disaggregation_entry(model: StreamingModel) -> dict[str, Any]:
    """A disaggregated model's prefill pool, for the router's first step (`pods` is then
    the decode pool): the same shape as `pods`, selecting the pool's role."""
    prefill = pool_view(model, "prefill")
    return {"prefill": {**router_pods(prefill), "selector": selector_labels(prefill)}}


def activator_entry(
    model: StreamingModel, split: Mapping[str, Any] | None = None
) -> dict[str, Any] | None:
    """The model's entry in models.json; None without scale to zero or the router.
    `split`: the owner's split (`split.split_entry`), for a router model."""
    if not in_activator(model):
        return None
    # A router model without scale to zero holds (no Ready pod) by the same defaults.
    zero = model.spec.scale_to_zero or ScaleToZeroSpec()
    entry: dict[str, Any] = {
        "host": upstream_host(model),
        "port": PORT,
        "holdTimeoutSeconds": model.spec.hold_timeout_seconds,
        "maxHeld": zero.max_held,
        "keepaliveSeconds": KEEPALIVE_SECONDS,
    }
    if model.routed:
        entry["pods"] = router_pods(model)
        entry["balance"] = model.spec.routing.balance
        migration = migration_entry(model)
        if migration is not None:
            entry["migration"] = migration
        if model.disaggregated:
            entry["disaggregation"] = disaggregation_entry(model)
        if split is not None:
            entry["split"] = dict(split)
    return entry


def models_entries(models: Iterable[StreamingModel]) -> dict[str, dict[str, Any]]:
    """models.json's entries, by `model_key`: of every model the activator knows, an owner
    of a split with its versions as checked against the other `models` (all of them, not
    only the ones the activator knows: a version without the router takes no share)."""
    models = list(models)
    by_namespace: dict[str, dict[str, StreamingModel | None]] = {}
    for m in models:
        by_namespace.setdefault(m.namespace, {})[m.name] = m
    out = {}
    for m in models:
        split = None
        if m.routed and m.spec.routing.router.split:
            split = split_entry(m, check_versions(m, by_namespace[m.namespace]))
        entry = activator_entry(m, split)
        if entry is not None:
            out[model_key(m)] = entry
    return out


def models_json(entries: Mapping[str, Mapping[str, Any]]) -> str:
    """models.json: sorted keys, so the same models always make the same bytes."""
    return json.dumps(dict(entries), sort_keys=True, indent=1) + "\n"


def desired_models_config_map(
    name: str, namespace: str, models: Iterable[StreamingModel]
) -> dict[str, Any]:
    """The operator's one ConfigMap of every model the activator knows (`name`: the
    activator's, plus `-models`). Owned by no model: the chart names it, the operator
    keeps its data. `models`: every model with a valid spec (`models_entries`)."""
    entries = models_entries(models)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": name + CONFIG_MAP_SUFFIX,
            "namespace": namespace,
            "labels": {MANAGED_BY_LABEL: MANAGER, "app.kubernetes.io/component": "activator"},
        },
        "data": {MODELS_FILE: models_json(entries)},
    }


def activator_host_of(service: str, namespace: str) -> str:
    return f"{service}.{namespace}.svc.cluster.local"
