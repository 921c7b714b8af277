"""operator/README.md's module map ("## Modules") names every module of the package, and only
modules that exist: the one-hop guide to where each behaviour lives stays true."""

from __future__ import annotations

import re
from pathlib import Path

from operator_helpers import ROOT

# The checkout's sources, next to the README they are compared with.
PACKAGE = ROOT / "operator" / "sluice_operator"
README = ROOT / "operator" / "README.md"


def mapped(text: str) -> list[str]:
    """`- `path`: ...` lines of the Modules section: files, and packages as `dir/`."""
    section = text.split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^- `([\w/]+(?:\.py|/))`:", section, re.M)


def modules() -> set[str]:
    """Every module file, and every subpackage as `dir/` (its __init__), relative to the package."""
    out = set()
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if rel.name != "__init__.py":
            out.add(rel.as_posix())
        elif rel.parent != Path("."):
            out.add(f"{rel.parent.as_posix()}/")
    return out


def problems(text: str, present: set[str]) -> list[str]:
    listed = mapped(text)
    out = [f"listed twice: {m}" for m in sorted({m for m in listed if listed.count(m) > 1})]
    out += [f"not in the map: {m}" for m in sorted(present - set(listed))]
    out += [f"mapped but missing: {m}" for m in sorted(set(listed) - present)]
    return out


def test_module_map_lists_every_module_once():
    assert not problems(README.read_text(), modules()), "fix operator/README.md, Modules"


def test_module_map_check_has_teeth():
    text = README.read_text()
    assert problems(text.replace("- `kinds.py`:", "- kinds.py:"), modules()) == [
        "not in the map: kinds.py"
    ]
    assert problems(text, modules() - {"yamldump.py"}) == ["mapped but missing: yamldump.py"]
