"""Helpers shared by the operator tests (a plain module: conftest.py names collide across test dirs)."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = sorted((ROOT / "samples").glob("*.yaml"))
INVALID_SAMPLES = sorted((ROOT / "samples" / "invalid").glob("*.yaml"))
# Kubernetes versions the rendered manifests are validated against (schemas ship offline in
# kubernetes-validate); the oldest and newest minor we support.
K8S_VERSIONS = ("1.33", "1.35")


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def expectations(path: Path) -> dict[str, str]:
    """`# expect-operator: ...` / `# expect-apiserver: ...` header lines of an invalid sample."""
    out = {}
    for line in path.read_text().splitlines():
        if line.startswith("# expect-"):
            key, _, value = line[2:].partition(":")
            out[key.strip()] = value.strip()
    return out
