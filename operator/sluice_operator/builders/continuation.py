"""Streams that outlive their pod (docs/migration.md): who holds which continuation key.

The router holds ONE master key (the operator chart's Secret, mounted in the router's pods
and in the operator's). Each model's key is derived from it, `continuation_key`: hex of
HMAC-SHA256(master, "<namespace>/<name>"), the same bytes as the server's
`sluice_server.core.auth.routerkey.model_key` (a test keeps them equal; the operator's image
does not ship the server). So a namespace's Secret holds only its own models' keys, and the
router derives the key of any model it relays without reading a Secret.

For a model whose streams migrate (`migrates`: the router on and running, migration on, and
the operator given the master key), the operator:

- writes the Secret `<name>-continuation-key` (key `key`) in the model's namespace
  (`desired_continuation_secret`); it applies it without reading it (reconcile.py), and
  deletes it when the model stops migrating;
- mounts it read-only in the model's serving pods at CONTINUATION_DIR, with the server's
  `--continuation-key-file` pointing there (`continuation_volumes`, `continuation_args`):
  only these models' pod templates change;
- adds `migration` (maxMigrations, stallSeconds) to the model's entry in the router's
  models file (`migration_entry`).

The pods read the key file at each continuation, so a rotated master key applies once the
operator re-derived the Secrets and the kubelet refreshed the volumes (within about a
minute); no pod restarts.

Pure: the model in (the master key is on its `defaults`), manifests out.
"""

from __future__ import annotations

import base64
import hmac
from typing import Any

from ..models.resource import StreamingModel
from ..models.status import ConditionType
from .common import metadata

CONTINUATION_SUFFIX = "-continuation-key"
SECRET_KEY = "key"  # the data key of the model's Secret
CONTINUATION_DIR = "/etc/sluice/continuation"
CONTINUATION_FILE = "key"
CONTINUATION_VOLUME = "continuation-key"
MIGRATION_CONDITION: ConditionType = "StreamMigration"


def continuation_key(master: bytes, namespace: str, name: str) -> bytes:
    """One model's continuation key, derived from the router's master key: hex of
    HMAC-SHA256(master stripped, "<namespace>/<name>") (routerkey.model_key on the server)."""
    return hmac.new(master.strip(), f"{namespace}/{name}".encode(), "sha256").hexdigest().encode()


def continuation_secret_name(model: StreamingModel) -> str:
    return model.name + CONTINUATION_SUFFIX


def migrates(model: StreamingModel) -> bool:
    """The router relays the model's streams and continues them on another replica: the
    model opts in (router and migration on), the operator runs the router, and it has the
    master key to give the pods theirs."""
    return (
        model.via_router
        and model.spec.routing.router.migration.enabled
        and model.defaults.continuation_key is not None
    )


def desired_continuation_secret(model: StreamingModel) -> dict[str, Any] | None:
    """`<name>-continuation-key`: the model's key, which its pods and the router share;
    None when the model's streams do not migrate."""
    master = model.defaults.continuation_key
    if not migrates(model) or master is None:
        return None
    key = continuation_key(master, model.namespace, model.name)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(model, name=continuation_secret_name(model)),
        "type": "Opaque",
        "data": {SECRET_KEY: base64.b64encode(key).decode()},
    }


def continuation_volumes(
    model: StreamingModel,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The Secret volume and the serving container's read-only mount (whole volume, no
    subPath, so the kubelet's refresh of a rotated key reaches the running pod).

    Optional: a pod whose Secret is gone (deleted by hand, or by the operator once the model
    stopped migrating while a paced rollout still keeps pods of the old template) starts
    anyway, and answers a continuation 503 (no key to read) instead of never starting."""
    if not migrates(model):
        return [], []
    items = [{"key": SECRET_KEY, "path": CONTINUATION_FILE}]
    volume = {
        "name": CONTINUATION_VOLUME,
        "secret": {
            "secretName": continuation_secret_name(model),
            "items": items,
            "defaultMode": 0o440,
            "optional": True,
        },
    }
    mount = {"name": CONTINUATION_VOLUME, "mountPath": CONTINUATION_DIR, "readOnly": True}
    return [volume], [mount]


def continuation_args(model: StreamingModel) -> list[str]:
    """The server flag that turns on `POST /internal/continue` and the router's marks."""
    if not migrates(model):
        return []
    return ["--continuation-key-file", f"{CONTINUATION_DIR}/{CONTINUATION_FILE}"]


def migration_entry(model: StreamingModel) -> dict[str, Any] | None:
    """`migration` in the model's entry of the router's models file; None: the router
    continues none of its streams."""
    if not migrates(model):
        return None
    m = model.spec.routing.router.migration
    return {"maxMigrations": m.max_migrations, "stallSeconds": m.stall_seconds}


# The chart value that gives the operator (and the router) the master key.
KEY_CHART_VALUE = "activator.continuationKey"


# Why a model's streams do not migrate when the API server refused its Secret (403).
SECRETS_FORBIDDEN = (
    "the operator may not write the Secret {secret}, so the pods get no continuation key and "
    "a stream ends with its pod: upgrade the sluice-operator chart (its RBAC grants create, "
    "patch and delete on secrets)"
)


def migration_verdict(
    model: StreamingModel, forbidden: bool = False
) -> tuple[bool, str, str] | None:
    """(status, reason, message) of the StreamMigration condition; None (no condition) for a
    model that does not ask for migration (router or migration off). `forbidden`: the API
    server refused to let the operator write the model's Secret."""
    if not model.spec.routing.router.migrates:
        return None
    if forbidden:
        return False, "Forbidden", SECRETS_FORBIDDEN.format(secret=continuation_secret_name(model))
    if not model.router_available:
        return (
            False,
            "RouterDisabled",
            "the operator runs without the router, which is what continues streams: a "
            "stream ends with its pod",
        )
    if model.defaults.continuation_key is None:
        return (
            False,
            "NoContinuationKey",
            "routing.router.migration.enabled, but the operator has no continuation key (its "
            "--continuation-key-file: the sluice-operator chart mounts "
            f"{KEY_CHART_VALUE}'s Secret): a stream ends with its pod, and the pods get no key",
        )
    m = model.spec.routing.router.migration
    return (
        True,
        "Enabled",
        f"the router continues a stream whose pod goes away on another Ready replica (at "
        f"most {m.max_migrations} times per stream; an upstream silent for "
        f"{m.stall_seconds:g} s counts as broken); the pods read their key from Secret "
        f"{continuation_secret_name(model)}",
    )
