"""How a model's weights cache stands (`spec.model.cache.weights`), from its status and
its download Job: which commit the pods mount, condition `WeightsReady`, `status.weights`,
the Event, and whether the pass must look again soon. Pure: the pass (reconcile.py) reads
the Job, its pods and the running pod's progress, and writes what this decides.

- The status remembers the commit the pods serve (`status.weights`): with the same claim,
  repository, revision and refresh annotation (the Job's name says all four) nothing is
  read at all. A revision change keeps the pods on the old commit until the new one is
  ready, then they roll; `previousCommit` says the old one awaits its clean-up.
- Progress reaches the operator by polling: while a download runs, the pass asks the
  download pod's `GET /progress` (files and bytes done of total) and asks kopf to run it
  again after WEIGHTS_RECHECK_SECONDS (passes.py); no pass polls once the Job finished.
- The Job's result is its container's termination message: the program's JSON outcome.
  A failed Job is not retried by the operator (its pods were, BACKOFF_LIMIT times): the
  condition says why and how to retry (a new refresh annotation, or a spec change).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .builders.weights import (
    BACKOFF_LIMIT,
    cache_of,
    fetch_job_name,
    repo_and_revision,
)
from .models.resource import WEIGHTS_REFRESH_ANNOTATION, StreamingModel
from .models.status import ConditionType
from .validation import SpecError, load_model

WEIGHTS_CONDITION: ConditionType = "WeightsReady"
WEIGHTS_RECHECK_SECONDS = 15
# The program's outcomes (its result's "outcome") and the condition reason of each failure.
FAILURE_REASONS = {
    "unauthorized": "Unauthorized",
    "gated": "Gated",
    "not_found": "RevisionNotFound",
    "no_space": "NoSpace",
    "corrupt": "Corrupt",
    "unreachable": "HubUnreachable",
    "error": "DownloadFailed",
}
# What a person does about each (appended to the program's message).
FIXES = {
    "unauthorized": "set spec.model.hfTokenSecretRef to a Secret with a valid token",
    "gated": "accept the model's licence on the Hub with the token's account, or set "
    "spec.model.hfTokenSecretRef",
    "not_found": "check the repository and revision in spec.model.uri",
    "no_space": "grow the claim (or remove other revisions from it)",
    "corrupt": "the files did not match the Hub's metadata twice; check the mirror",
    "unreachable": "check the cluster's egress to the Hub, or set "
    "spec.model.cache.weights.hubEndpoint to a mirror",
}
# WeightsReady reasons after which no Job of the model writes to the claim any more.
STOPPED_REASONS = {*FAILURE_REASONS.values(), "ClaimMissing"}
COMMIT = re.compile(r"^[0-9a-f]{40}$")
# How the program's `ready` message names the files it downloaded again (fetch.py).
REDONE = "downloaded again after a check failed: "
RETRY_HINT = f"to retry, set the annotation {WEIGHTS_REFRESH_ANNOTATION} to a new value"


@dataclass
class JobView:
    """What the pass read about the download Job: the Job (None: absent), its pods, and the
    running pod's progress (None: not running, or not answering)."""

    job: Mapping[str, Any] | None
    pods: Sequence[Mapping[str, Any]] = ()
    progress: Mapping[str, Any] | None = None


@dataclass
class WeightsVerdict:
    commit: str | None  # what the pods mount; None: no pods
    record: dict[str, Any] | None  # status.weights
    condition: dict[str, str]
    events: list[tuple[str, str, str]] = field(default_factory=list)
    settling: bool = False  # a download runs: look again soon
    create_job: bool = False
    delete_job: bool = False  # finished, but its result is gone: run it again
    failed: bool = False


def _cond(ok: bool | None, reason: str, message: str) -> dict[str, str]:
    status = "Unknown" if ok is None else ("True" if ok else "False")
    return {"type": WEIGHTS_CONDITION, "status": status, "reason": reason, "message": message}


def _job_condition(job: Mapping[str, Any], type_: str) -> bool:
    return any(
        c.get("type") == type_ and c.get("status") == "True"
        for c in (job.get("status") or {}).get("conditions") or []
    )


def _started(pod: Mapping[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("creationTimestamp") or "")


def termination_results(pods: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The program's JSON results in the pods' termination messages, newest pod first
    (a message that is not the program's JSON becomes an "error" outcome)."""
    out = []
    for pod in sorted(pods, key=_started, reverse=True):
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            term = (cs.get("state") or {}).get("terminated") or {}
            if not term:
                continue
            text = term.get("message") or ""
            try:
                result = json.loads(text)
                if not isinstance(result, dict) or "outcome" not in result:
                    raise ValueError
            except ValueError:
                why = (
                    text.strip()[:300] or term.get("reason") or f"exit code {term.get('exitCode')}"
                )
                result = {"outcome": "error", "message": f"the download container ended: {why}"}
            out.append(result)
    return out


def _size(n: Any) -> str:
    try:
        value = float(n)
    except (TypeError, ValueError):
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return "?"


def progress_message(what: str, progress: Mapping[str, Any]) -> str:
    commit = progress.get("commit")
    at = f"{what} (commit {str(commit)[:12]})" if commit else what
    return (
        f"downloading {at}: {progress.get('files_done', 0)}/{progress.get('files_total', '?')} "
        f"files, {_size(progress.get('bytes_done', 0))} of {_size(progress.get('bytes_total'))}"
    )


def _pending_message(pods: Sequence[Mapping[str, Any]]) -> str | None:
    for pod in pods:
        st = pod.get("status") or {}
        for c in st.get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False":
                return (
                    f"the download pod cannot be scheduled: {c.get('message') or c.get('reason')}"
                )
        for cs in st.get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") not in (None, "ContainerCreating", "PodInitializing"):
                return f"the download pod is waiting: {waiting.get('reason')}: {waiting.get('message', '')}"
    return None


def weights_verdict(
    model: StreamingModel, previous: Mapping[str, Any], view: JobView | None, now: str
) -> WeightsVerdict:
    """`view` None: the pass did not read the Job (the status says the commit is ready)."""
    cache = cache_of(model)
    assert cache is not None
    repo, revision = repo_and_revision(model)
    job_name = fetch_job_name(model)
    what = f"{repo}@{revision}"
    prev = dict(previous.get("weights") or {})
    same_repo = prev.get("claimName") == cache.claim_name and prev.get("repo") == repo
    served = prev.get("commit") if same_repo else None
    record = prev if same_repo else None
    keeping = f"; the pods keep serving commit {str(served)[:12]}" if served else ""

    if same_repo and prev.get("job") == job_name and served:
        message = (
            f"{what} is commit {served} ({prev.get('files', '?')} files, "
            f"{_size(prev.get('bytes'))}) on claim {cache.claim_name}"
        )
        return WeightsVerdict(served, record, _cond(True, "Ready", message))
    if view is None or view.job is None:
        message = f"creating the download Job {job_name} for {what}{keeping}"
        return WeightsVerdict(
            served, record, _cond(False, "Resolving", message), settling=True, create_job=True
        )
    results = termination_results(view.pods)
    if _job_condition(view.job, "Complete"):
        ready = next((r for r in results if r.get("outcome") == "ready" and r.get("commit")), None)
        if ready is None:
            message = (
                f"the download Job {job_name} completed but its result is gone (its pods "
                f"were removed): running it again{keeping}"
            )
            return WeightsVerdict(
                served, record, _cond(None, "ResultLost", message), settling=True, delete_job=True
            )
        commit = str(ready["commit"])
        new = {
            "claimName": cache.claim_name,
            "repo": repo,
            "revision": revision,
            "commit": commit,
            "resolvedAt": now,
            "files": ready.get("files"),
            "bytes": ready.get("bytes"),
            "job": job_name,
        }
        if served and served != commit:
            new["previousCommit"] = served
        elif prev.get("previousCommit") and same_repo:
            new["previousCommit"] = prev["previousCommit"]
        message = (
            f"{what} is commit {commit} ({new['files'] if new['files'] is not None else '?'} "
            f"files, {_size(new['bytes'])}) on claim {cache.claim_name}"
        )
        # The program's note of files that failed a check and were downloaded again goes
        # into the Event (the condition keeps the message every later pass rebuilds).
        note = str(ready.get("message") or "")
        redone = note[note.find(REDONE) :] if REDONE in note else ""
        events = [("Normal", "WeightsReady", f"{message}; {redone}" if redone else message)]
        return WeightsVerdict(commit, new, _cond(True, "Ready", message), events)
    if _job_condition(view.job, "Failed"):
        result = results[0] if results else {"outcome": "error", "message": "no result"}
        outcome = str(result.get("outcome", "error"))
        reason = FAILURE_REASONS.get(outcome, "DownloadFailed")
        fix = FIXES.get(outcome)
        message = (
            f"downloading {what} failed ({outcome}): {result.get('message') or 'no message'}"
            + (f"; {fix}" if fix else "")
            + f"; {RETRY_HINT}{keeping}"
        )
        before: Mapping[str, Any] = next(
            (c for c in previous.get("conditions") or [] if c.get("type") == WEIGHTS_CONDITION),
            {},
        )
        events = [] if before.get("message") == message else [("Warning", reason, message)]
        return WeightsVerdict(
            served, record, _cond(False, reason, message), events, failed=served is None
        )
    # Running (or about to).
    if view.progress and view.progress.get("phase") not in (None, "resolving"):
        message = progress_message(what, view.progress) + keeping
        return WeightsVerdict(served, record, _cond(False, "Downloading", message), settling=True)
    pending = _pending_message(view.pods)
    failures = [r for r in results if r.get("outcome") != "ready"]
    if pending:
        message = pending
    elif failures:
        last = failures[0]
        message = (
            f"attempt {len(failures)} of {BACKOFF_LIMIT + 1} to download {what} failed "
            f"({last.get('outcome')}: {last.get('message') or 'no message'}); retrying"
        )
    else:
        message = f"the download Job {job_name} is resolving {what}"
    return WeightsVerdict(
        served, record, _cond(False, "Resolving", message + keeping), settling=True
    )


@dataclass
class WeightsUsers:
    """Who uses a repository on a claim, among a namespace's models: the commits they serve
    or still roll from (`keep`), and a model whose download of the repository runs towards
    a commit nobody knows yet (`busy`: its name; a clean-up must wait for it, since the
    commit it resolves to may be one a clean-up would remove)."""

    keep: set[str] = field(default_factory=set)
    busy: str | None = None


def weights_users(claim: str, repo: str, bodies: Iterable[Mapping[str, Any]]) -> WeightsUsers:
    """The users of `repo` on `claim` among `bodies` (StreamingModels as stored), by their
    status (the commits their pods mount) and by their spec: a model created a moment ago
    has no status yet but names the claim and the repository, and its Job is about to
    write there. A pinned commit in a spec is kept without waiting; a branch or tag is
    `busy` until the model's status records what it resolved to (or its download failed
    for good: a failed Job writes nothing more)."""
    users = WeightsUsers()
    for body in bodies:
        st = body.get("status") or {}
        w = st.get("weights") or {}
        if w.get("claimName") == claim and w.get("repo") == repo:
            users.keep.update(str(c) for c in (w.get("commit"), w.get("previousCommit")) if c)
        try:
            model = load_model(body)
        except (SpecError, KeyError, ValueError):
            continue  # an invalid spec gets no Job
        cache = cache_of(model)
        if cache is None or cache.claim_name != claim or model.source.kind != "hf":
            continue
        wanted, revision = repo_and_revision(model)
        if wanted != repo:
            continue
        if COMMIT.fullmatch(revision):
            users.keep.add(revision)
            continue
        if w.get("job") == fetch_job_name(model) and w.get("commit"):
            continue  # its status records what this spec resolved to
        cond: Mapping[str, Any] = next(
            (c for c in st.get("conditions") or [] if c.get("type") == WEIGHTS_CONDITION), {}
        )
        if cond.get("reason") in STOPPED_REASONS:
            continue
        users.busy = users.busy or str((body.get("metadata") or {}).get("name"))
    return users
