"""An earlier commit of this repository as a source tree: the release an upgrade starts from.

There are no release tags yet, so upgrade tests pin a commit: `PINNED`, the main branch
before leader election and rollout pacing (one operator replica, `Recreate`, no template
hash on Deployments). `git archive` writes its operator, chart, CRD and samples into a
folder; a clone without that history (a shallow one) skips the tests that need it.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
from pathlib import Path

from testkit.repo import ROOT

PINNED = "1cdc7fa"
PATHS = ("operator", "charts", "crds", "samples")


def missing(commit: str = PINNED) -> str | None:
    if not shutil.which("git"):
        return "git not found: cannot check out the pinned release"
    found = subprocess.run(
        ["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True
    )
    if found.returncode != 0:
        return f"commit {commit} is not in this clone (shallow?): cannot test upgrades from it"
    return None


def checkout(dest: Path, commit: str = PINNED) -> Path:
    """`commit`'s operator/, charts/, crds/ and samples/ under `dest`."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", commit, *PATHS],
        check=True,
        capture_output=True,
    ).stdout
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    return dest
