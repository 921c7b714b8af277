"""status.adapters and condition AdaptersReady: how the pods stand with each LoRA adapter.

How a pod's adapter state reaches the status. Pods have no API token
(`automountServiceAccountToken: false`) and expose no admin route, so they cannot write a
pod condition, an Event or an annotation themselves. What they already publish, with no
credential, is `/metrics` (Prometheus scrapes it): each server process exports
`sluice_adapter_state{adapter, id, state, reason}` (the pod's value is the maximum over its
workers). The operator reads that page from each ready pod (`http://<podIP>:8000/metrics`,
GET, a short timeout) only for models with adapters, and this module folds the pages into
the status. That needs no RBAC beyond the pod list and watch the operator already has, and
nothing on the pod that writes. The price is a network path from the operator to the
pods' port, as Prometheus needs: with spec.networkPolicy on, list the operator's namespace
in monitoringNamespaces (and, with the operator chart's NetworkPolicy on, allow its egress
to the pods, `networkPolicy.modelPodPorts`). A pod the operator cannot read makes the
adapter Unknown, never Failed, and serving does not depend on it.

The `id` label is the operator's digest of the adapter (builders/adapters.py): a pod still
on an older list (the kubelet refreshes a mounted ConfigMap within about a minute) reports
another id or none, and counts as Loading.

Pure: the pages come in as text.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from .builders.adapters import adapter_id, lora_args
from .models.resource import StreamingModel
from .models.status import ConditionType

CONDITION: ConditionType = "AdaptersReady"
_SAMPLE = re.compile(r"^sluice_adapter_state\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)", re.M)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def adapter_states(text: str) -> dict[tuple[str, str], tuple[str, str]]:
    """(adapter, id) -> (state, reason) of one pod's /metrics page (samples at 1)."""
    out: dict[tuple[str, str], tuple[str, str]] = {}
    rank = {"Failed": 3, "Loading": 2, "Ready": 1}
    for m in _SAMPLE.finditer(text):
        try:
            if float(m.group("value")) < 1:
                continue
        except ValueError:
            continue
        labels = {
            k: v.replace('\\"', '"').replace("\\\\", "\\")
            for k, v in _LABEL.findall(m.group("labels"))
        }
        key = (labels.get("adapter", ""), labels.get("id", ""))
        state = (labels.get("state", ""), labels.get("reason", ""))
        if key not in out or rank.get(state[0], 0) > rank.get(out[key][0], 0):
            out[key] = state  # several workers: the worst state wins
    return out


def _pod_name(pod: Mapping[str, Any]) -> str:
    return (pod.get("metadata") or {}).get("name", "?")


def ready(pod: Mapping[str, Any]) -> bool:
    st = pod.get("status") or {}
    return bool(st.get("podIP")) and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or []
    )


def engine_restart(model: StreamingModel, pods: Iterable[Mapping[str, Any]]) -> bool:
    """Pods run with other LoRA engine settings than the spec asks for: they are being
    replaced (engine.lora changed, or LoRA turned on or off)."""
    want = lora_args(model)
    for pod in pods:
        containers = (pod.get("spec") or {}).get("containers") or []
        args = list((containers[0] if containers else {}).get("args") or [])
        have = lora_args_of(args)
        if have != want:
            return True
    return False


def lora_args_of(args: list[str]) -> list[str]:
    """The LoRA flags in a server command line (what lora_args rendered), in order."""
    flags = ("--adapters-file", "--max-loras", "--max-lora-rank", "--max-cpu-loras")
    out: list[str] = []
    for i, a in enumerate(args):
        if a == "--":
            break
        if a in flags and i + 1 < len(args):
            out += [a, args[i + 1]]
    return out


def adapters_status(
    model: StreamingModel,
    pods: Iterable[Mapping[str, Any]],
    pages: Mapping[str, str | None],
) -> tuple[list[dict[str, Any]], dict[str, str]] | None:
    """(status.adapters, condition AdaptersReady) from the ready pods' pages (pod name ->
    text, None when it could not be read); None when LoRA is off."""
    if not model.spec.lora_enabled:
        return None
    pods = list(pods)
    serving = [p for p in pods if ready(p)]
    states = {
        _pod_name(p): adapter_states(t) if (t := pages.get(_pod_name(p))) else None for p in serving
    }
    entries = []
    for a in model.spec.adapters:
        key = (a.name, adapter_id(a))
        failed, loading, ok, unread = [], [], 0, 0
        for pod, seen in states.items():
            if seen is None:
                unread += 1
                continue
            state, reason = seen.get(key, ("", ""))
            if state == "Failed":
                failed.append(f"pod {pod}: {reason or 'failed to load'}")
            elif state == "Ready":
                ok += 1
            else:
                loading.append(pod)
        entry: dict[str, Any] = {"name": a.name, "readyPods": f"{ok}/{len(serving)}"}
        if failed:
            entry.update(state="Failed", reason="LoadFailed", message="; ".join(failed)[:1024])
        elif loading:
            entry.update(
                state="Loading",
                reason="Loading",
                message=(
                    f"not served yet by {', '.join(sorted(loading)[:5])} (loading, or the pod has "
                    "not seen the new adapter list yet)"
                ),
            )
        elif ok:
            entry.update(state="Ready", reason="Served", message="")
        else:
            why = "no ready pod" if not serving else "no pod's /metrics could be read"
            entry.update(
                state="Unknown",
                reason="NoReport",
                message=why
                + (
                    f" ({unread} unreachable: with spec.networkPolicy, list the operator's "
                    "namespace in monitoringNamespaces)"
                    if unread
                    else ""
                ),
            )
        entries.append(entry)
    return entries, _condition(model, pods, entries)


def _condition(model: StreamingModel, pods: list, entries: list[dict]) -> dict[str, str]:
    if engine_restart(model, pods):
        return {
            "type": CONDITION,
            "status": "False",
            "reason": "EngineRestart",
            "message": "the LoRA engine settings changed (engine.lora, or LoRA turned on "
            "or off): the pods are replaced to restart the engine (a rolling update); "
            "adding or removing adapters alone never does this",
        }
    failed = [e["name"] for e in entries if e["state"] == "Failed"]
    waiting = [e["name"] for e in entries if e["state"] in ("Loading", "Unknown")]
    if failed:
        return {
            "type": CONDITION,
            "status": "False",
            "reason": "AdapterFailed",
            "message": f"failed: {', '.join(failed)} (see status.adapters); the others "
            "and the base serve",
        }
    if waiting:
        return {
            "type": CONDITION,
            "status": "Unknown" if not any(e["state"] == "Loading" for e in entries) else "False",
            "reason": "Loading",
            "message": f"not served everywhere yet: {', '.join(waiting)}",
        }
    return {
        "type": CONDITION,
        "status": "True",
        "reason": "AllServed",
        "message": f"{len(entries)} adapter(s) served by every ready pod",
    }


def settling(entries: list[dict[str, Any]] | None) -> bool:
    """Some adapter is still Loading: the status should be looked at again soon."""
    return any(e["state"] == "Loading" for e in entries or [])
