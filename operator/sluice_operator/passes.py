"""A model's pass as the handlers run it: under the model's lock, read from memory, and
what went wrong classified for kopf.

- An invalid spec is permanent (`kopf.PermanentError`): retrying cannot help until the
  spec changes, which triggers a pass anyway. The pass already reported it (status, Event).
- An API error or an unreachable API server is temporary (`kopf.TemporaryError`), retried
  with a backoff that doubles up to `MAX_BACKOFF_SECONDS`.
- A lost Lease mid-pass (`WriteFenced`) ends the pass quietly: the new leader converges it.
- A namespace being deleted (403 "being terminated") ends it quietly too.
- A deleted model's weights (`release_weights`): its commits are removed from the claim
  when no other model uses them; a clean-up that must wait for another model's download
  is tried again by the resync (`retry_releases`).
- Adapters still loading, a LeaderWorkerSet not yet updated and Ready, or a weights
  download running, ask kopf to look again soon: no watch event follows any of them.

A pass nobody retries (a child event, the resync) is `converge_quietly`: it logs instead.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import kopf

from .cluster import Cluster, WriteFenced, pod_metrics_page, weights_progress
from .cluster_view import ClusterView
from .continuationkey import ContinuationKeyFile
from .kinds import STREAMING_MODEL
from .modellocks import ModelLocks
from .models.resource import OperatorDefaults
from .pacing import RolloutPacer
from .reconcile import Outcome, converge, release_weights
from .scaletozero import ZeroContext
from .validation import SpecError
from .weightsstate import WEIGHTS_RECHECK_SECONDS

log = logging.getLogger("sluice_operator.passes")

MAX_BACKOFF_SECONDS = 300
ADAPTER_RECHECK_SECONDS = 10
# A LeaderWorkerSet rolling or starting: its status is read, not watched (`kinds.py`).
WORKLOAD_RECHECK_SECONDS = 10


def backoff(retry: int) -> float:
    return float(min(MAX_BACKOFF_SECONDS, 5 * 2**retry))


def _poster(body: Any, cluster: Cluster) -> Callable[[str, str, str], None]:
    may_write = getattr(cluster, "may_write", None)

    def post(type_: str, reason: str, message: str) -> None:
        if may_write is not None and not may_write():
            raise WriteFenced(f"not the leader: Event {reason} not posted")
        kopf.event(body, type=type_, reason=reason, message=message[:1024])

    return post


def _owner_check(cluster: Cluster, body: Any) -> Callable[[], bool]:
    """One GET, only before a pass creates a child: is this model still there (memory may
    not have seen its deletion yet, while the garbage collector removes the children)?"""
    meta = body["metadata"]

    def exists() -> bool:
        sm = STREAMING_MODEL
        live = cluster.get(sm.api_version, sm.kind, meta["namespace"], meta["name"])
        live_meta = (live or {}).get("metadata") or {}
        return live_meta.get("uid") == meta.get("uid") and not live_meta.get("deletionTimestamp")

    return exists


@dataclass(frozen=True)
class Passes:
    """What every pass of the operator shares: the cluster it writes to, the memory it reads,
    one lock per model, the rollout pacer and the scale-to-zero context (None: no pacing;
    the default activator address and no signals), and the operator's defaults for what a
    model leaves unset (its image), with the continuation key read at each pass from
    `key_file` (None: no key, no stream migrates)."""

    cluster: Cluster
    memory: ClusterView
    locks: ModelLocks
    pacer: RolloutPacer | None = None
    zero: ZeroContext | None = None
    defaults: OperatorDefaults = OperatorDefaults()
    key_file: ContinuationKeyFile | None = None
    # Deleted models whose weights' clean-up waits for another model's download:
    # (namespace, uid) -> the model's last body. In memory only (see release_weights).
    waiting_releases: dict[tuple[str, str], Any] = field(default_factory=dict)
    _release_guard: threading.Lock = field(default_factory=threading.Lock)

    def operator_defaults(self) -> OperatorDefaults:
        """`defaults` with the continuation key as the file holds it now."""
        return self.defaults if self.key_file is None else self.key_file.defaults(self.defaults)

    def converge(
        self,
        namespace: str,
        name: str,
        retry: int,
        logger: kopf.Logger,
        collapsible: bool = False,
    ) -> None:
        """Converge one StreamingModel, read from memory under its lock.

        Handlers race (the create handler and the first child events arrive together);
        reading the object inside the lock, with the status the previous pass wrote
        (`ClusterView.wrote`), means each pass compares against that status, so it neither writes
        it again nor loses lastTransitionTime.
        """
        from kubernetes.client.exceptions import ApiException

        cluster, memory = self.cluster, self.memory
        outcomes: list[Outcome] = []

        def converge_once() -> None:
            try:
                body = memory.model(namespace, name)
                if body is None or body["metadata"].get("deletionTimestamp"):
                    return  # gone or going: the garbage collector removes the children
                check = _owner_check(cluster, body)
                outcomes.append(
                    converge(
                        cluster,
                        body,
                        _poster(body, cluster),
                        reads=memory,
                        owner_exists=check,
                        pacer=self.pacer,
                        pod_metrics=pod_metrics_page,
                        zero=self.zero,
                        defaults=self.operator_defaults(),
                        weights_progress=weights_progress,
                    )
                )
            except WriteFenced as exc:
                # Lost the Lease mid-pass: nothing more is sent; the new leader converges it.
                log.info(f"pass of {namespace}/{name} stopped: {exc}")
            except SpecError as exc:
                # Permanent: retrying cannot help until the spec changes (which re-triggers us).
                raise kopf.PermanentError(f"invalid spec: {exc}") from None
            except ApiException as exc:
                if exc.status == 403 and "being terminated" in (exc.body or ""):
                    return  # the namespace is going away, and the StreamingModel with it
                reason = f"Kubernetes API {exc.status} {exc.reason}"
                raise kopf.TemporaryError(reason, delay=backoff(retry)) from None
            except OSError as exc:  # connection refused/reset, DNS: the API server will be back
                raise kopf.TemporaryError(
                    f"cannot reach the API server: {exc}", delay=backoff(retry)
                ) from None

        self.locks.run((namespace, name), converge_once, collapsible)
        for outcome in outcomes:
            if outcome.applied or outcome.deleted or outcome.status_written:
                logger.info(
                    f"converged: phase={outcome.phase} applied={outcome.applied} "
                    f"deleted={outcome.deleted}"
                )
        if not collapsible and any(o.adapters_settling for o in outcomes):
            # No event follows an adapter finishing its load on a pod: look again soon, until
            # every adapter is Ready or Failed.
            raise kopf.TemporaryError("LoRA adapters still loading", delay=ADAPTER_RECHECK_SECONDS)
        if not collapsible and any(o.workload_settling for o in outcomes):
            # No watch event follows the LeaderWorkerSet's status: read it again soon, until
            # its groups are updated and Ready (the status and a paced rollout's slot follow
            # it).
            raise kopf.TemporaryError(
                "the LeaderWorkerSet's groups are not all updated and Ready yet",
                delay=WORKLOAD_RECHECK_SECONDS,
            )
        if not collapsible and any(o.weights_settling for o in outcomes):
            # The download Job is not watched: poll its progress and its end.
            raise kopf.TemporaryError("the weights are downloading", delay=WEIGHTS_RECHECK_SECONDS)

    def release_weights(self, namespace: str, body: Any, logger: Any) -> None:
        """A StreamingModel was deleted (its last body, from the watch's DELETED event): its
        commits leave the claim unless another model of the namespace uses them
        (`reconcile.release_weights`). No finalizer holds the model for it (deletion must
        not hang while the operator is down), so the decision rests on this event: one that
        must wait for another model's download is kept here and tried again by every resync
        round (`retry_releases`); an operator restart in between forgets it
        (docs/weights-cache.md says what is left then)."""
        meta = body.get("metadata") or {}
        key = (namespace, str(meta.get("uid") or meta.get("name")))

        def once() -> None:
            neighbours = []
            for ns, name in self.memory.models():
                other = self.memory.model(ns, name) if ns == namespace else None
                if other is not None:
                    neighbours.append(other)
            try:
                done = release_weights(
                    self.cluster,
                    body,
                    neighbours,
                    _poster(body, self.cluster),
                    self.operator_defaults(),
                )
            except WriteFenced as exc:
                log.info(f"clean-up of {namespace}/{meta.get('name')}'s weights stopped: {exc}")
                return  # the new leader never saw the DELETED event: nothing more to do
            except Exception as exc:
                status, text = getattr(exc, "status", None), str(getattr(exc, "body", "") or "")
                # The namespace is going away (its models with it), or is gone: nothing to do.
                done = status == 404 or (status == 403 and "being terminated" in text)
                if not done:  # an API error: try again on the next resync round
                    logger.warning(
                        f"cleaning up the weights of {namespace}/{meta.get('name')}: {exc}"
                    )
            with self._release_guard:
                if done:
                    self.waiting_releases.pop(key, None)
                else:
                    self.waiting_releases[key] = body
            if not done:
                log.info(f"clean-up of {namespace}/{meta.get('name')}'s weights waits")

        # One clean-up decision at a time per namespace.
        self.locks.run((namespace, "\0weights-release"), once)

    def retry_releases(self, logger: Any) -> None:
        with self._release_guard:
            waiting = list(self.waiting_releases.items())
        for (namespace, _), body in waiting:
            self.release_weights(namespace, body, logger)

    def converge_quietly(self, namespace: str, name: str, logger: kopf.Logger, why: str) -> None:
        """A pass nobody retries (child event, resync): errors are logged, never raised."""
        try:
            self.converge(namespace, name, 0, logger, collapsible=True)
        except kopf.PermanentError:
            pass  # already reported on the StreamingModel (status + Event)
        except kopf.TemporaryError as exc:
            # A watch event must never crash; the next event, the resync or the owner's
            # handler retries.
            logger.warning(f"converging {namespace}/{name} after {why} failed: {exc}")
