"""`render`: the manifests the operator would apply, as multi-document YAML (for GitOps/review).

Owner references are not rendered: the operator adds them at apply time (they need the
StreamingModel's uid, which only exists in a cluster).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from .kinds import desired_children
from .models.resource import OperatorDefaults
from .validation import load_model
from .yamldump import dump_yaml


def render_objects(
    body: dict[str, Any], namespace: str | None = None, *, defaults: OperatorDefaults | None = None
) -> list[dict[str, Any]]:
    model = load_model(body, namespace=namespace, defaults=defaults)
    return [m for m in desired_children(model).values() if m is not None]


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
