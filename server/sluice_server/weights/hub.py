"""The Hub through `huggingface_hub`, the client vLLM itself uses: a revision resolved to a
commit with every file's size and hashes (`model_info(files_metadata=True)`, that is
`GET {endpoint}/api/models/{repo}/revision/{rev}?blobs=true`), one file downloaded into the
commit's folder (`hf_hub_download(local_dir=...)`: its HEAD for the ETag, its ranged
resume when a connection drops, Xet where the Hub and `hf_xet` offer it), and the
library's errors read as an outcome with a sentence a person can act on."""

from __future__ import annotations

import errno
import functools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import httpx2
from huggingface_hub import HfApi, constants, hf_hub_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from .layout import ManifestEntry, relative_file
from .progress import ChunkBar, Progress
from .result import FetchFailure, Outcome

log = logging.getLogger("sluice.weights")
T = TypeVar("T")

_TRANSIENT_STATUS = (408, 429, 500, 502, 503, 504)


@dataclass(frozen=True)
class Snapshot:
    commit: str
    gated: bool
    files: list[ManifestEntry]


class Hub:
    """One repository's Hub (or mirror: `HF_ENDPOINT`), with the token of `--token-file`
    only: never the environment's `HF_TOKEN` nor a token file in `HF_HOME`. A transient
    failure (connection refused or cut, a timeout, 429, 5xx) is retried `attempts` times in
    all, waiting `retry_wait` seconds doubled each time (at most 30 s), then is
    `unreachable`."""

    def __init__(self, token: str | None, *, endpoint: str | None = None, attempts: int = 5,
                 retry_wait: float = 2.0, sleep: Callable[[float], None] = time.sleep) -> None:  # fmt: skip
        # huggingface_hub reads HF_ENDPOINT once, at import; an explicit endpoint (the tests')
        # is handed to every call.
        self.endpoint = (endpoint or constants.ENDPOINT).rstrip("/")
        self._token = token
        self._attempts = max(1, attempts)
        self._retry_wait = retry_wait
        self._sleep = sleep

    @property
    def has_token(self) -> bool:
        return self._token is not None

    def resolve(self, repo: str, revision: str) -> Snapshot:
        def call() -> Snapshot:
            api = HfApi(endpoint=self.endpoint, token=self._token or False)
            info = api.model_info(repo, revision=revision, files_metadata=True)
            if not info.sha:
                raise FetchFailure(
                    Outcome.ERROR,
                    f"{self.endpoint} answered for {repo}@{revision} without a commit: is HF_ENDPOINT a Hub or a Hub mirror?",
                )
            files = []
            for s in info.siblings or []:
                relative_file(s.rfilename)
                size = s.lfs.size if s.lfs is not None else s.size
                if size is None:
                    raise FetchFailure(
                        Outcome.ERROR,
                        f"{self.endpoint} listed {s.rfilename} of {repo}@{revision} without its size: is HF_ENDPOINT a Hub or a Hub mirror?",
                    )
                files.append(ManifestEntry(path=s.rfilename, size=size,
                                           sha256=s.lfs.sha256 if s.lfs is not None else None,
                                           blob_id=s.blob_id))  # fmt: skip
            return Snapshot(commit=info.sha, gated=bool(info.gated), files=files)

        return self._retrying(call, repo=repo, revision=revision, what="resolving the revision")

    def download(self, repo: str, commit: str, entry: ManifestEntry, folder: Path,
                 progress: Progress) -> None:  # fmt: skip
        def call() -> None:
            progress.restart_file()
            hf_hub_download(
                repo_id=repo,
                filename=entry.path,
                revision=commit,
                local_dir=folder,
                token=self._token or False,
                endpoint=self.endpoint,
                tqdm_class=cast(Any, functools.partial(ChunkBar, progress)),
            )

        self._retrying(call, repo=repo, revision=commit, what=f"downloading {entry.path}")

    def _retrying(self, call: Callable[[], T], *, repo: str, revision: str, what: str) -> T:
        wait = self._retry_wait
        for attempt in range(1, self._attempts + 1):
            try:
                return call()
            except FetchFailure:
                raise
            except Exception as e:
                failure = self.classify(e, repo=repo, revision=revision)
                if failure.outcome is not Outcome.UNREACHABLE or attempt == self._attempts:
                    raise failure from e
                log.warning("%s of %s failed (attempt %d of %d, retrying in %g s): %s",
                            what, repo, attempt, self._attempts, wait, _short(e))  # fmt: skip
                self._sleep(wait)
                wait = min(wait * 2, 30.0)
        raise AssertionError("unreachable")

    def classify(self, error: BaseException, *, repo: str, revision: str) -> FetchFailure:
        """The outcome of a failed call, from the exception or what it was raised from."""
        at = self.endpoint
        for e in _chain(error):
            if isinstance(e, OSError) and e.errno == errno.ENOSPC:
                return FetchFailure(
                    Outcome.NO_SPACE,
                    f"the cache volume ran out of space while downloading {repo}@{revision}: give its PVC more space, or remove revisions nothing uses",
                )
            if isinstance(e, GatedRepoError):
                if self.has_token:
                    return FetchFailure(
                        Outcome.GATED,
                        f"the Hub refused the token for {repo}, a gated model: accept the model's license on the Hub with the account the token belongs to, and check the token in the Secret the cache names",
                    )
                return FetchFailure(
                    Outcome.GATED,
                    f"{repo} is a gated model and no token was given: accept its license on the Hub, then put a token of that account in the Secret the cache names",
                )
            if isinstance(e, RevisionNotFoundError):
                return FetchFailure(
                    Outcome.NOT_FOUND,
                    f"{repo} has no revision {revision!r} on {at}: name an existing branch, tag or commit",
                )
            if isinstance(e, RemoteEntryNotFoundError):
                return FetchFailure(
                    Outcome.NOT_FOUND,
                    f"{at} listed a file of {repo}@{revision} that it then did not serve ({_short(e)}); if HF_ENDPOINT is a mirror, check that it holds this revision whole",
                )
            if isinstance(e, HfHubHTTPError) and e.response is not None:
                status = e.response.status_code
                if status == 401:
                    if self.has_token:
                        return FetchFailure(
                            Outcome.UNAUTHORIZED,
                            f"the Hub refused the token for {repo} (401): check that the token in the Secret the cache names is valid and can read {repo}",
                        )
                    return FetchFailure(
                        Outcome.UNAUTHORIZED,
                        f"the Hub refused to show {repo} without a token (401): the repository is private or gated, or does not exist; if it exists, put a token that can read it in the Secret the cache names",
                    )
                if isinstance(e, RepositoryNotFoundError) or status == 404:
                    return FetchFailure(
                        Outcome.NOT_FOUND,
                        f"{repo} does not exist on {at}"
                        + (", or the token's account cannot see it" if self.has_token else "")
                        + ": check the repository name",
                    )
                if status == 403:
                    return FetchFailure(
                        Outcome.UNAUTHORIZED,
                        f"the Hub refused access to {repo} (403): check that the token in the Secret the cache names has read access to it",
                    )
                if status in _TRANSIENT_STATUS:
                    return FetchFailure(
                        Outcome.UNREACHABLE,
                        f"{at} answered {status} for {repo}@{revision}: the Hub (or the mirror in HF_ENDPOINT) is down or rate limiting; the Job retries",
                    )
            if isinstance(
                e, httpx2.TransportError | LocalEntryNotFoundError | ConnectionError | TimeoutError
            ):
                return FetchFailure(
                    Outcome.UNREACHABLE,
                    f"could not reach {at} for {repo}@{revision} ({_short(e)}): check the cluster's egress to the Hub, or set HF_ENDPOINT to a mirror it can reach",
                )
            if isinstance(e, OSError) and "Consistency check failed" in str(e):
                return FetchFailure(
                    Outcome.UNREACHABLE,
                    f"the transfer of a file of {repo}@{revision} from {at} ended short ({_short(e)}); the Job retries",
                )
        return FetchFailure(
            Outcome.ERROR, f"downloading {repo}@{revision} from {at} failed: {_short(error)}"
        )


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."
