"""The cache volume's layout: `<root>/<org>/<name>/<commit>/<files...>`, with the marker
`.sluice-weights.json` written last in a commit's folder (present = complete), and removal
of a repository's other commits, never outside the root."""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath

import filelock

MARKER = ".sluice-weights.json"
# What a download keeps beside the files until the marker is written: huggingface_hub's
# local-dir metadata (`.cache/huggingface/`) and our record of verified files
# (`.cache/sluice/`). Removed before the marker, so a complete folder holds the files only.
WORK_DIR = ".cache"

COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
# The Hub's rule for a repository id, in the `org/name` form the cache is laid out by.
_REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def check_repo(repo: str) -> str:
    if not _REPO_RE.fullmatch(repo) or ".." in repo:
        raise ValueError(f"{repo!r} is not a Hub repository id of the form org/name")
    return repo


def check_commit(commit: str) -> str:
    if not COMMIT_RE.fullmatch(commit):
        raise ValueError(f"{commit!r} is not a commit (40 lowercase hex digits)")
    return commit


def is_commit(revision: str) -> bool:
    return COMMIT_RE.fullmatch(revision) is not None


def repo_dir(root: Path, repo: str) -> Path:
    org, name = check_repo(repo).split("/")
    return root / org / name


def commit_dir(root: Path, repo: str, commit: str) -> Path:
    return repo_dir(root, repo) / check_commit(commit)


def relative_file(path: str) -> PurePosixPath:
    """A repository file's path, refused if it would leave the commit's folder or collide
    with what the download keeps there."""
    p = PurePosixPath(path)
    if p.is_absolute() or not p.parts or ".." in p.parts or p.parts[0] in (WORK_DIR, MARKER):
        raise ValueError(f"the Hub listed a file named {path!r}, which the cache cannot hold")
    return p


@dataclass(frozen=True)
class ManifestEntry:
    path: str
    size: int
    sha256: str | None  # LFS files
    blob_id: str | None  # git's blob SHA-1 (every file)


def read_marker(folder: Path) -> dict | None:
    try:
        doc = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def complete(folder: Path) -> dict | None:
    """The marker of a complete commit folder whose files are all there with their sizes,
    else None. Sizes only: hashing a model's files again on every run would cost minutes,
    and the hashes were checked before the marker was written."""
    doc = read_marker(folder)
    if doc is None:
        return None
    for entry in doc.get("manifest", []):
        try:
            if (folder / relative_file(entry["path"])).stat().st_size != entry["size"]:
                return None
        except (OSError, KeyError, TypeError, ValueError):
            return None
    return doc


def write_marker(folder: Path, *, repo: str, revision: str, commit: str,
                 manifest: list[ManifestEntry]) -> dict:  # fmt: skip
    """The marker, atomically (a temporary file renamed over), after the folder's data and
    the directory are synced: a reader that sees it sees every file."""
    doc = {
        "repo": repo,
        "revision": revision,
        "commit": commit,
        "files": len(manifest),
        "bytes": sum(e.size for e in manifest),
        "verifiedAt": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "manifest": [
            {"path": e.path, "size": e.size, "sha256": e.sha256, "blobId": e.blob_id}
            for e in manifest
        ],
    }
    tmp = folder / (MARKER + ".tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MARKER)
    fsync_dir(folder)
    return doc


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _inside(root: Path, path: Path) -> bool:
    real_root = root.resolve()
    real = path.resolve()
    return real == real_root or real_root in real.parents


def lock_path(folder: Path) -> Path:
    """The commit folder's writer lock (fetch holds it while it fills the folder)."""
    return folder / WORK_DIR / "sluice" / "lock"


def _take_unless_writing(folder: Path) -> filelock.BaseFileLock | None | bool:
    """The folder's lock, taken (so no download starts in it while it is removed); None: the
    folder has no lock file (nothing was ever written under one, or it is complete); False:
    a download holds it now."""
    path = lock_path(folder)
    if not path.exists():
        return None
    lock = filelock.FileLock(path)
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        return False
    except OSError:
        return None  # a volume without file locks: as before locks
    return lock


def remove_other_commits(
    root: Path, repo: str, keep: list[str]
) -> tuple[list[str], int, list[str]]:
    """Remove the repository's commit folders not in `keep`; returns the commits removed,
    the bytes freed and the commits skipped because a download is writing them now (its
    lock is held: a model the caller did not know of yet). Only folders named like a
    commit are touched (anything else under the repository's folder is left); a repository
    folder or commit folder that resolves outside the root (a symlink) is refused with
    ValueError."""
    for c in keep:
        check_commit(c)
    folder = repo_dir(root, repo)
    if not _inside(root, folder):
        raise ValueError(f"{folder} resolves outside the cache root {root}: refusing to remove")
    if not folder.is_dir():
        return [], 0, []
    removed, skipped, freed = [], [], 0
    for child in sorted(folder.iterdir()):
        if child.name in keep or not COMMIT_RE.fullmatch(child.name):
            continue
        if child.is_symlink() or not _inside(root, child):
            raise ValueError(f"{child} resolves outside the cache root {root}: refusing to remove")
        if not child.is_dir():
            continue
        lock = _take_unless_writing(child)
        if lock is False:
            skipped.append(child.name)
            continue
        try:
            freed += sum(
                p.stat().st_size for p in child.rglob("*") if p.is_file() and not p.is_symlink()
            )
            # The marker first: a reader never sees a marked folder with files missing.
            (child / MARKER).unlink(missing_ok=True)
            shutil.rmtree(child)
        finally:
            if isinstance(lock, filelock.BaseFileLock):
                lock.release()
        removed.append(child.name)
    return removed, freed, skipped
