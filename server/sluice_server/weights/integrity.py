"""A downloaded file against the Hub's metadata: its size, and its sha256 (LFS files) or
git's blob SHA-1 (the others, whose `blobId` the Hub lists), and the record of a file
already checked, so that a run that resumes does not read a finished file again."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from .layout import WORK_DIR, ManifestEntry

_CHUNK = 8 * 1024 * 1024


def mismatch(path: Path, entry: ManifestEntry, *, hashes: bool = True) -> str | None:
    """None if the file is what the Hub describes, else what differs. Syncs the file's data
    to the volume while it is open (the marker promises the files are there)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "missing"
    if size != entry.size:
        return f"size {size} instead of {entry.size}"
    if not hashes:
        return None
    if entry.sha256 is not None:
        digest = hashlib.sha256()
        expected, name = entry.sha256, "sha256"
    elif entry.blob_id is not None:
        digest = hashlib.sha1(f"blob {size}\0".encode(), usedforsecurity=False)
        expected, name = entry.blob_id, "git blob SHA-1"
    else:
        return None
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
        os.fsync(f.fileno())
    got = digest.hexdigest()
    return None if got == expected else f"{name} {got} instead of {expected}"


def _record_path(folder: Path, entry: ManifestEntry) -> Path:
    return folder / WORK_DIR / "sluice" / "verified" / (entry.path + ".json")


def record_verified(folder: Path, entry: ManifestEntry) -> None:
    st = (folder / entry.path).stat()
    record = _record_path(folder, entry)
    record.parent.mkdir(parents=True, exist_ok=True)
    tmp = record.with_suffix(".tmp")
    tmp.write_text(json.dumps({"size": st.st_size, "mtimeNs": st.st_mtime_ns,
                               "sha256": entry.sha256, "blobId": entry.blob_id}))  # fmt: skip
    os.replace(tmp, record)


def verified_before(folder: Path, entry: ManifestEntry) -> bool:
    """Whether this very file (same size and modification time) was checked against the
    same metadata by an earlier run."""
    try:
        doc = json.loads(_record_path(folder, entry).read_text())
        st = (folder / entry.path).stat()
    except (OSError, ValueError):
        return False
    return doc == {"size": st.st_size, "mtimeNs": st.st_mtime_ns,
                   "sha256": entry.sha256, "blobId": entry.blob_id}  # fmt: skip


def forget(folder: Path, entry: ManifestEntry) -> None:
    """Remove a file and every record of it (ours and huggingface_hub's local-dir
    metadata, which would otherwise call the file current)."""
    (folder / entry.path).unlink(missing_ok=True)
    _record_path(folder, entry).unlink(missing_ok=True)
    hf = folder / WORK_DIR / "huggingface" / "download"
    (hf / (entry.path + ".metadata")).unlink(missing_ok=True)
