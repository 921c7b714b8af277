"""One run of `fetch`: a revision of a repository into its commit's folder, every file
checked, the marker last. A run that finds the folder complete ends at once (with a commit
for a revision, before any network); one that finds finished files keeps them."""

from __future__ import annotations

import errno
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import filelock

from . import integrity
from .hub import Hub, Snapshot
from .layout import (
    MARKER,
    WORK_DIR,
    ManifestEntry,
    commit_dir,
    complete,
    is_commit,
    lock_path,
    write_marker,
)
from .progress import Progress
from .result import FetchFailure, Outcome, Result

log = logging.getLogger("sluice.weights")


@dataclass(frozen=True)
class Request:
    repo: str
    revision: str
    root: Path


def free_space(path: Path) -> int:
    return shutil.disk_usage(path).free


def fetch(request: Request, hub: Hub, progress: Progress, *,
          free_bytes: Callable[[Path], int] = free_space, verify_hashes: bool = True) -> Result:  # fmt: skip
    """Run to an outcome; never raises for what the Hub, the network or the volume do.
    `verify_hashes=False` is for the test that shows the hashes are what catches a damaged
    file; the program has no flag for it."""
    commit: str | None = None
    try:
        doc = None
        if is_commit(request.revision):
            commit = request.revision
            doc = complete(commit_dir(request.root, request.repo, commit))
        if doc is None:
            snapshot = hub.resolve(request.repo, request.revision)
            commit = snapshot.commit
            progress.set(commit=commit, files_total=len(snapshot.files),
                         bytes_total=sum(e.size for e in snapshot.files))  # fmt: skip
            log.info("%s@%s is commit %s: %d files, %s", request.repo, request.revision,
                     commit, len(snapshot.files), _size(progress.bytes_total))  # fmt: skip
            doc = _fill(request, hub, snapshot, progress, free_bytes, verify_hashes)
        else:
            log.info("%s@%s is complete already: no file fetched", request.repo, commit)
        progress.set(phase="ready", commit=commit, files_total=doc["files"], files_done=doc["files"],
                     bytes_total=doc["bytes"], bytes_done=doc["bytes"])  # fmt: skip
        message = (f"{request.repo}@{request.revision} (commit {commit}) is ready: {doc['files']} "
                   f"files, {_size(doc['bytes'])}, checked against the Hub's metadata")  # fmt: skip
        if doc.get("redone"):
            message += "; downloaded again after a check failed: " + "; ".join(doc["redone"])
        return Result(Outcome.READY.label, request.repo, request.revision, commit, doc["files"],
                      doc["bytes"], message)  # fmt: skip
    except FetchFailure as failure:
        outcome, message = failure.outcome, failure.message
    except OSError as e:
        if e.errno != errno.ENOSPC:
            log.exception("unexpected error")
            outcome, message = (
                Outcome.ERROR,
                f"fetching {request.repo}@{request.revision} failed: {e}",
            )
        else:
            outcome, message = Outcome.NO_SPACE, _no_space(request, progress, free_bytes)
    except Exception as e:
        log.exception("unexpected error")
        outcome, message = (
            Outcome.ERROR,
            f"fetching {request.repo}@{request.revision} failed: {type(e).__name__}: {e}",
        )
    if outcome is Outcome.NO_SPACE and "volume at" not in message:
        message = _no_space(request, progress, free_bytes)
    progress.set(phase="failed")
    snap = progress.snapshot()
    log.error("%s: %s", outcome.label, message)
    return Result(outcome.label, request.repo, request.revision, commit, snap["files_done"],
                  snap["bytes_done"], message)  # fmt: skip


def _fill(request: Request, hub: Hub, snapshot: Snapshot, progress: Progress,
          free_bytes: Callable[[Path], int], verify_hashes: bool) -> dict:  # fmt: skip
    folder = commit_dir(request.root, request.repo, snapshot.commit)
    if (doc := complete(folder)) is not None:
        log.info("%s@%s is complete already: no file fetched", request.repo, snapshot.commit)
        return doc
    if snapshot.gated and not hub.has_token:
        raise FetchFailure(
            Outcome.GATED,
            f"{request.repo} is a gated model and no token was given: accept its license on the Hub, then put a token of that account in the Secret the cache names",
        )
    work = folder / WORK_DIR / "sluice"
    work.mkdir(parents=True, exist_ok=True)
    # One writer per commit folder (two revisions may resolve to the same commit). A run that
    # waits here finds the folder complete when it gets the lock.
    lock: filelock.BaseFileLock | None = filelock.FileLock(lock_path(folder))
    try:
        assert lock is not None
        try:
            lock.acquire(timeout=1)
        except filelock.Timeout:
            log.info(
                "another download of %s is writing %s: waiting for it", snapshot.commit, folder
            )
            lock.acquire()
    except (NotImplementedError, PermissionError, OSError) as e:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise
        # A volume without file locks: the operator runs one Job per revision anyway.
        log.warning("cannot lock %s (%s): going on without the lock", folder, e)
        lock = None
    try:
        if (doc := complete(folder)) is not None:
            return doc
        return _fill_locked(request, hub, snapshot, folder, progress, free_bytes, verify_hashes)
    finally:
        if lock is not None:
            lock.release()


def _fill_locked(request: Request, hub: Hub, snapshot: Snapshot, folder: Path, progress: Progress,
                 free_bytes: Callable[[Path], int], verify_hashes: bool) -> dict:  # fmt: skip
    # A marker over files that are no longer all there goes first: pods must not take the
    # folder for complete while it is filled again.
    (folder / MARKER).unlink(missing_ok=True)
    # A run killed mid-file leaves huggingface_hub's temporary file (a unique name per run).
    for stale in (folder / WORK_DIR / "huggingface" / "download").rglob("*.incomplete"):
        stale.unlink(missing_ok=True)
    kept: set[str] = set()
    present: set[str] = set()
    for e in snapshot.files:
        path = folder / e.path
        if verify_hashes and integrity.verified_before(folder, e):
            kept.add(e.path)
        elif path.is_file() and path.stat().st_size == e.size:
            present.add(e.path)
        else:
            integrity.forget(folder, e)
    needed = sum(e.size for e in snapshot.files if e.path not in kept | present)
    free = free_bytes(request.root)
    if free < needed:
        raise FetchFailure(
            Outcome.NO_SPACE,
            f"the cache volume at {request.root} has {_size(free)} free, and {request.repo}@{request.revision} (commit {snapshot.commit}) needs {_size(needed)} more ({_size(progress.bytes_total)} in all): give the cache's PVC more space, or remove revisions nothing uses",
        )
    progress.set(phase="downloading")
    started = time.monotonic()
    fetched = 0
    redone: list[str] = []  # "path (what did not match)", for the result's message
    for e in snapshot.files:
        n = f"[{progress.files_done + 1}/{len(snapshot.files)}]"
        if e.path in kept:
            progress.file_done(e.size)
            log.info("%s kept %s (%s, checked by an earlier run)", n, e.path, _size(e.size))
            continue
        if e.path in present:
            problem = integrity.mismatch(folder / e.path, e, hashes=verify_hashes)
            if problem is None:
                integrity.record_verified(folder, e)
                progress.file_done(e.size)
                log.info(
                    "%s kept %s (%s, already there, %s)",
                    n,
                    e.path,
                    _size(e.size),
                    _checked(e, verify_hashes),
                )
                continue
            log.warning(
                "%s %s on the volume does not match the Hub (%s): downloading it again",
                n,
                e.path,
                problem,
            )
            integrity.forget(folder, e)
            redone.append(f"{e.path} (on the volume: {problem})")
        for attempt in (1, 2):
            hub.download(request.repo, snapshot.commit, e, folder, progress)
            problem = integrity.mismatch(folder / e.path, e, hashes=verify_hashes)
            if problem is None:
                break
            integrity.forget(folder, e)
            if attempt == 2:
                raise FetchFailure(
                    Outcome.CORRUPT,
                    f"{e.path} of {request.repo} (commit {snapshot.commit}) arrived damaged twice ({problem}): the Hub or the mirror in HF_ENDPOINT serves bytes that do not match its own metadata; the Job retries, and a mirror may need the file fetched again",
                )
            log.warning(
                "%s %s arrived damaged (%s): deleted, downloading it again", n, e.path, problem
            )
            redone.append(f"{e.path} (arrived damaged: {problem})")
        integrity.record_verified(folder, e)
        progress.file_done(e.size)
        fetched += e.size
        log.info("%s fetched %s (%s, %s) %s of %s", n, e.path, _size(e.size), _checked(e, verify_hashes),
                 _size(progress.bytes_done), _size(progress.bytes_total))  # fmt: skip
    progress.set(phase="verifying")
    for e in snapshot.files:  # sizes only: each file's hash was checked as it arrived
        if (problem := integrity.mismatch(folder / e.path, e, hashes=False)) is not None:
            raise FetchFailure(
                Outcome.CORRUPT,
                f"{e.path} of {request.repo} (commit {snapshot.commit}) changed on the volume during the download ({problem}): is another writer using {folder}?",
            )
    shutil.rmtree(folder / WORK_DIR, ignore_errors=True)
    manifest: list[ManifestEntry] = list(snapshot.files)
    doc = write_marker(folder, repo=request.repo, revision=request.revision, commit=snapshot.commit,
                       manifest=manifest)  # fmt: skip
    elapsed = time.monotonic() - started
    log.info("%s@%s ready in %s: %d files, %s (%s fetched in %.1f s)", request.repo, request.revision,
             folder, doc["files"], _size(doc["bytes"]), _size(fetched), elapsed)  # fmt: skip
    return {**doc, "redone": redone}


def _checked(e: ManifestEntry, hashes: bool) -> str:
    if not hashes:
        return "size checked"
    return (
        "sha256 checked"
        if e.sha256
        else ("git blob SHA-1 checked" if e.blob_id else "size checked")
    )


def _no_space(request: Request, progress: Progress, free_bytes: Callable[[Path], int]) -> str:
    try:
        free = _size(free_bytes(request.root))
    except OSError:
        free = "unknown"
    snap = progress.snapshot()
    left = snap["bytes_total"] - snap["bytes_done"]
    return f"the cache volume at {request.root} ran out of space ({free} free, {_size(left)} of {request.repo}@{request.revision} still to download): give the cache's PVC more space, or remove revisions nothing uses"


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit} ({n:,} bytes)"
    return f"{n:,} bytes"
