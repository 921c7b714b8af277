"""`render`: the manifests the operator would apply, as multi-document YAML (for GitOps/review).

Owner references are not rendered: the operator adds them at apply time (they need the
StreamingModel's uid, which only exists in a cluster).

A model of the weights cache (`spec.model.cache.weights`) is rendered as its pods will be
once its weights are ready: on the commit its status records, or the revision when that is
a commit (40 hex digits); a branch or tag that no status resolved renders no workload (the
operator's download Job resolves it in the cluster).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import yaml

from .builders.weights import cache_of
from .kinds import desired_children
from .models.resource import OperatorDefaults, StreamingModel
from .validation import load_model
from .yamldump import dump_yaml


def render_objects(
    body: dict[str, Any], namespace: str | None = None, *, defaults: OperatorDefaults | None = None
) -> list[dict[str, Any]]:
    model = offline_weights(load_model(body, namespace=namespace, defaults=defaults), body)
    return [m for m in desired_children(model).values() if m is not None]


COMMIT = re.compile(r"^[0-9a-f]{40}$")


def offline_weights(model: StreamingModel, body: dict[str, Any]) -> StreamingModel:
    """The commit a model of the weights cache is rendered on (see the module's doc)."""
    cache = cache_of(model)
    if cache is None:
        return model
    recorded = (body.get("status") or {}).get("weights") or {}
    revision = model.source.revision or ""
    if recorded.get("claimName") == cache.claim_name and recorded.get("commit"):
        commit: str | None = str(recorded["commit"])
    else:
        commit = revision if COMMIT.match(revision) else None
    return dataclasses.replace(model, weights_commit=commit)


def render_file(
    path: Path, namespace: str | None = None, *, defaults: OperatorDefaults | None = None
) -> str:
    """Render every StreamingModel in a file (`-` reads stdin); other documents are skipped."""
    import sys

    text = sys.stdin.read() if str(path) == "-" else path.read_text()
    docs = [d for d in yaml.safe_load_all(text) if d]
    out = []
    for body in docs:
        if body.get("kind") != "StreamingModel":
            continue
        for manifest in render_objects(body, namespace=namespace, defaults=defaults):
            out.append(dump_yaml(manifest))
    return "---\n" + "---\n".join(out) if out else ""
