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


# Official upstream CRDs (Gateway API, the Inference Extension, ...) kept beside the checkout
# in `../shared/crds` (see its INDEX.md), never copied into the project; SLUICE_SHARED_CRDS
# points elsewhere (a git worktree one level deeper). Absent in a user's clone: the tests that
# need them skip.
SHARED_CRDS = Path(os.environ.get("SLUICE_SHARED_CRDS") or ROOT.parent / "shared" / "crds")


def shared_crd(relative: str) -> Path | None:
    """An official CRD file under `SHARED_CRDS`, or None where that folder lacks it."""
    path = SHARED_CRDS / relative
    return path if path.is_file() else None
