"""Where things are in the repository, for every suite and for the benchmark scripts."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Binaries `make tools` installs (helm, kubectl, nginx wrappers): searched before PATH.
TOOLS_BIN = ROOT / ".tools" / "bin"


def find_tool(name: str, *extra_dirs: str) -> str | None:
    """`name` from `extra_dirs` first, then `.tools/bin`, then PATH; None when absent."""
    path = os.pathsep.join(
        [*(d for d in extra_dirs if d), str(TOOLS_BIN), os.environ.get("PATH", "")]
    )
    return shutil.which(name, path=path)
