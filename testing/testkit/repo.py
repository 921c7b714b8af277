"""Where things are in the repository, for every suite and for the benchmark scripts."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Binaries `make tools` installs (helm, kubectl, nginx wrappers): searched before PATH.
TOOLS_BIN = ROOT / ".tools" / "bin"
# The official LeaderWorkerSet CRD (LWS v0.10.0), relative to a `shared/crds/` folder.
LWS_CRD = "lws/leaderworkerset.x-k8s.io_leaderworkersets.yaml"


def find_tool(name: str, *extra_dirs: str) -> str | None:
    """`name` from `extra_dirs` first, then `.tools/bin`, then PATH; None when absent."""
    path = os.pathsep.join(
        [*(d for d in extra_dirs if d), str(TOOLS_BIN), os.environ.get("PATH", "")]
    )
    return shutil.which(name, path=path)


# Official upstream CRDs (Gateway API, the Inference Extension, LeaderWorkerSet, ...) kept in
# the workplace's `shared/crds/` (next to the checkout or above it, see its INDEX.md), never
# copied into the project; SLUICE_SHARED_CRDS points elsewhere. Absent in a user's clone
# (CI): the tests that need them skip.
def shared_crd(relative: str) -> Path | None:
    """An official CRD file under the shared CRD folder, or None where none holds it."""
    override = os.environ.get("SLUICE_SHARED_CRDS")
    folders = [Path(override)] if override else [p / "shared" / "crds" for p in ROOT.parents]
    return next((f / relative for f in folders if (f / relative).is_file()), None)
