"""Layers: models, validation, builders, status and render are pure (no kopf, no API client);
only handlers/reconcile/cluster/runner may touch them. Checked from the import statements."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import sluice_operator

PKG = Path(sluice_operator.__file__).parent
PURE = sorted(
    [*PKG.glob("models/*.py"), *PKG.glob("builders/*.py")]
    + [PKG / n for n in ("validation.py", "status.py", "render.py", "yamldump.py")]
    + [*PKG.glob("generate/*.py")]
)
FORBIDDEN = ("kopf", "kubernetes")


def imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.ImportFrom) and node.level and node.module:
            names.add("." * node.level + node.module)
    return names


@pytest.mark.parametrize("path", PURE, ids=lambda p: str(p.relative_to(PKG)))
def test_pure_modules_do_not_import_kopf_or_the_client(path):
    bad = {n for n in imported(path) if n.split(".")[0] in FORBIDDEN}
    assert not bad, f"{path.name} imports {bad}"
    relative = {n.lstrip(".") for n in imported(path) if n.startswith(".")}
    assert not relative & {"handlers", "reconcile", "cluster", "runner"}, path.name


def test_the_checker_sees_kopf_where_it_is():
    assert "kopf" in imported(PKG / "handlers.py")  # negative control
