"""Every file the operator's generators write: where it goes and what it holds.

`python -m sluice_operator crds --write` writes them all and `--check` lists the stale
ones, so one command keeps the CRD (two identical copies), the API reference, the
streaming-model chart's values schema, the Grafana dashboard (built from the operator's
own queries) and docs/helm.md's values and RBAC tables (read from the charts) in step; a
test runs the check.
"""

from __future__ import annotations

from pathlib import Path

from . import chartdocs, dashboard
from .apidocs import render_api_doc
from .crd import CRD_FILENAME, build_crd, render_crd
from .values_schema import render_values_schema

# Repository-relative places the CRD is written to (identical copies: the plain manifests
# and the operator chart's crds/, which Helm installs before the templates).
CRD_PATHS = (Path("crds") / CRD_FILENAME, Path("charts/sluice-operator/crds") / CRD_FILENAME)
DOC_PATH = Path("docs/api.md")
VALUES_SCHEMA_PATH = Path("charts/streaming-model/values.schema.json")
# Shipped by the operator chart (grafanaDashboard.enabled) and imported by hand as is.
DASHBOARD_PATH = Path("charts/sluice-operator/files/grafana-dashboard.json")


def generated_files() -> dict[Path, str]:
    """Repository-relative path -> content of every generated file."""
    crd = build_crd()
    text = render_crd()
    return {
        **{rel: text for rel in CRD_PATHS},
        DOC_PATH: render_api_doc(crd),
        VALUES_SCHEMA_PATH: render_values_schema(crd),
        DASHBOARD_PATH: dashboard.render(),
        chartdocs.HELM_DOC: chartdocs.render_helm_doc(),
    }


def write_files(root: Path) -> list[Path]:
    written = []
    for rel, text in generated_files().items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written


def stale_files(root: Path) -> list[Path]:
    """Checked-in generated files that are missing or differ from what the models generate."""
    return [
        root / rel
        for rel, text in generated_files().items()
        if not (root / rel).is_file() or (root / rel).read_text() != text
    ]
