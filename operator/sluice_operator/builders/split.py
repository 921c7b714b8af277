"""A model version to a share of traffic (spec.routing.router.split, docs/versions.md).

The OWNER, the StreamingModel whose route is public, lists the other versions (other
StreamingModels of its namespace) and their weights; it keeps 100 minus their sum. The
router reads the split from the owner's entry in models.json (`split_entry`) and picks a
version per conversation. Whether each version can take its share needs the other objects,
which no CRD rule sees, so it is checked here (`check_versions`) and said on the owner
(condition TrafficSplit, `split_condition`):

- the version exists and its spec is valid;
- it uses the router: the router only reaches models it watches (an entry with `pods`);
- it serves the owner's public model name (model.servedName): the pods refuse a body whose
  `model` they do not serve, so a conversation sent to it would fail;
- its pods answer under the owner's path prefix: the router forwards the path as the
  client sent it (`/prefix/v1/...`), and a server answers under its own prefix alone (the
  Ingress's path, `--root-path`);
- it claims no host and path of the owner's Ingress or HTTPRoute: one host and path has one
  owner, the owner of the split (two Ingresses on one host and path are merged or refused
  depending on the controller). A route of the version on another host (a canary host for
  smoke tests) is fine;
- it declares no split of its own: the router follows one level.

A version that fails a check takes no traffic (weight 0 in models.json): its share stays
with the owner, which always works. Pure: models in, a verdict and a dict out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..models.resource import StreamingModel
from ..models.status import ConditionType
from .args import root_path

CONDITION: ConditionType = "TrafficSplit"
# A route without a host name: the controller's default server (paths compare without a
# trailing "/").
_ANY_HOST = "*"


@dataclass(frozen=True)
class VersionCheck:
    """One version of the owner's split as the checks found it."""

    model: str  # the StreamingModel's name (the owner's namespace)
    weight: int  # as the owner's spec asks
    reason: str = ""  # CamelCase reason it takes no traffic; "" when it takes its weight
    message: str = ""

    @property
    def applied(self) -> int:
        """The weight in models.json: the spec's, or 0 for a version that fails a check."""
        return 0 if self.reason else self.weight


def _routes(model: StreamingModel) -> set[tuple[str, str]]:
    """The (host, path) pairs the model's public route claims ("*": every host)."""
    spec = model.spec
    if spec.gateway is not None:
        path = spec.gateway.path.rstrip("/") or "/"
        return {(h, path) for h in spec.gateway.hostnames or [_ANY_HOST]}
    if spec.ingress.enabled:
        return {(spec.ingress.host or _ANY_HOST, spec.ingress.path.rstrip("/") or "/")}
    return set()


def claimed(owner: StreamingModel, version: StreamingModel) -> list[str]:
    """The owner's host+path pairs the version's route claims too, as `host/path` (`*/path`:
    neither names a host)."""
    return sorted(f"{host}{path}" for host, path in _routes(owner) & _routes(version))


def _check(owner: StreamingModel, name: str, version: StreamingModel | None) -> tuple[str, str]:
    ns = owner.namespace
    if version is None:
        return "VersionInvalid", (
            f"StreamingModel {name}'s spec is invalid (its condition SpecValid says why): fix it"
        )
    if not version.routed:
        return "VersionNotRouted", (
            f"StreamingModel {name} does not use the router, which only reaches the models "
            f"it watches: set spec.routing.router.enabled: true on {name}"
        )
    if version.spec.routing.router.split:
        return "VersionSplits", (
            f"StreamingModel {name} splits its own traffic (spec.routing.router.split): the "
            f"router follows one level; remove {name}'s split"
        )
    if version.served_name != owner.served_name:
        return "ServedNameDiffers", (
            f"StreamingModel {name} serves the model name {version.served_name!r}, "
            f"{owner.name} serves {owner.served_name!r}: clients send one name and {name}'s "
            f"pods would refuse it; set spec.model.servedName: {owner.served_name} on {name}"
        )
    if root_path(version) != root_path(owner):
        return "PathDiffers", (
            f"StreamingModel {name}'s pods answer under {root_path(version) or '/'}, "
            f"{owner.name}'s under {root_path(owner) or '/'}: the router forwards the path "
            f"as sent, so {name} would answer 404; give {name} an Ingress with path "
            f"{root_path(owner) or '/'} on another host (ingress.host), or none if the owner's "
            "path is /"
        )
    taken = claimed(owner, version)
    if taken:
        return "RouteClaimed", (
            f"StreamingModel {name}'s route claims {', '.join(taken)}, which {owner.name} "
            f"owns (the owner of the split owns the public route; one host and path has one "
            f"owner): give {name} another host or path, or turn its ingress or gateway off "
            f"(its own Service and the router's X-Sluice-Model: {ns}/{name} reach it)"
        )
    return "", ""


def check_versions(
    owner: StreamingModel, models: Mapping[str, StreamingModel | None]
) -> list[VersionCheck]:
    """Each version of the owner's split, in the spec's order, checked against `models`:
    the owner's namespace by name (None: the object exists, its spec is invalid)."""
    out = []
    for v in owner.spec.routing.router.split:
        if v.model not in models:
            reason, message = (
                "VersionMissing",
                (
                    f"StreamingModel {v.model} does not exist in namespace {owner.namespace}: "
                    f"create it, or remove it from spec.routing.router.split"
                ),
            )
        else:
            reason, message = _check(owner, v.model, models[v.model])
        out.append(VersionCheck(v.model, v.weight, reason, message))
    return out


def owner_weight(checks: list[VersionCheck]) -> int:
    return 100 - sum(c.applied for c in checks)


def split_entry(owner: StreamingModel, checks: list[VersionCheck]) -> dict[str, Any] | None:
    """The owner's `split` in models.json: every version with the weight the router applies,
    the owner first; None without a split."""
    if not owner.spec.routing.router.split:
        return None
    ns = owner.namespace
    versions = [{"model": f"{ns}/{owner.name}", "weight": owner_weight(checks)}]
    versions += [{"model": f"{ns}/{c.model}", "weight": c.applied} for c in checks]
    return {"versions": versions}


def _shares(owner: StreamingModel, checks: list[VersionCheck]) -> str:
    parts = [f"{owner.name} {owner_weight(checks)}%"]
    return ", ".join(parts + [f"{c.model} {c.applied}%" for c in checks])


def split_condition(owner: StreamingModel, checks: list[VersionCheck]) -> dict[str, str]:
    """Condition TrafficSplit: True when every version takes its weight; else the first
    failing version's reason, and every failure in the message."""
    if not owner.router_available:
        return {
            "type": CONDITION,
            "status": "False",
            "reason": "RouterDisabled",
            "message": "the operator chart runs no router (its activator.enabled), so the "
            f"route goes to Service {owner.name} and no conversation goes to another "
            "version: enable the chart's activator",
        }
    failed = [c for c in checks if c.reason]
    if not failed:
        return {
            "type": CONDITION,
            "status": "True",
            "reason": "Split",
            "message": f"conversations split {_shares(owner, checks)}",
        }
    lost = ", ".join(f"{c.model}'s {c.weight}%" for c in failed)
    return {
        "type": CONDITION,
        "status": "False",
        "reason": failed[0].reason,
        "message": "; ".join(c.message for c in failed)
        + f". Until then {owner.name} takes {lost} (split now {_shares(owner, checks)})",
    }
