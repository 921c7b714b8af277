"""kopf handlers: thin. Each one calls `reconcile.converge` and classifies what went wrong.

- StreamingModel created, changed (spec), or found at operator start -> converge.
- A child (Deployment, Service, Ingress, HPA, PDB) or one of the pods changed or was
  deleted -> converge its owner: hand edits are put back, status follows the rollout.
- Every `--resync-seconds` -> converge every model (a pass that failed after a child event
  is retried there); a settled model costs no API call.
Passes read the model, children and pods from memory (`memory.Memory`): one kopf index per
kind in `kinds.INDEXED_KINDS`, filled by the watches kopf runs anyway, plus the operator's
own writes. No kopf timers: they would put a finalizer on every StreamingModel (deletion
would then hang whenever the operator is down); the resync is a plain background thread.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Callable
from typing import Any

import kopf

from .builders.common import INSTANCE_LABEL, MANAGED_BY_LABEL, MANAGER
from .cluster import Cluster, KubeCluster, pod_metrics_page
from .kinds import INDEXED_KINDS, STREAMING_MODEL, WATCHED_KINDS, Kind
from .memory import Memory, index_key, lean
from .models import GROUP, PLURAL, VERSION
from .reconcile import converge
from .validation import SpecError

OURS = {MANAGED_BY_LABEL: MANAGER}
# (group, version, plural) of every child watch, from the one table of kinds.
CHILD_RESOURCES = tuple((k.group, k.version, k.plural) for k in WATCHED_KINDS)
MAX_BACKOFF_SECONDS = 300
ADAPTER_RECHECK_SECONDS = 10
DEFAULT_RESYNC_SECONDS = 300.0
# Threads for the (sync) handlers. A pass mostly waits on the API server, and every child
# and pod event runs one: with kopf's default (CPUs + 4) a burst of child events kept new
# models waiting (50 models at once: last model's children 6.9-8.4 s, 5.3-5.9 s with 20).
HANDLER_THREADS = 20


class _Entry:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0  # passes running or waiting for the lock
        self.dirty = False  # an event came in while a pass ran: run once more


class ModelLocks:
    """One converge at a time per StreamingModel, bursts collapsed, memory bounded.

    Child events arrive in bursts (a rollout touches the Deployment, its pods and the
    ReplicaSet-driven status many times a second). An event for a model whose pass is running
    or waiting only marks it dirty and returns at once; the pass, once done, runs once more
    if it was marked (it reads memory, so that one pass sees everything the burst changed).
    N events during a pass cost one more pass, not N, and hold no worker thread. The model's
    own handlers (create, update, resume) never skip: kopf retries them on failure, which a
    skipped pass would lose; they wait for the lock. An entry lives only while a pass runs or
    waits, so the table does not grow with every model ever seen (a deleted model leaves
    nothing behind).
    """

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._entries: dict[tuple[str, str], _Entry] = {}

    def __len__(self) -> int:
        with self._guard:
            return len(self._entries)

    def run(
        self, key: tuple[str, str], converge_once: Callable[[], None], collapsible: bool = False
    ) -> bool:
        """Run `converge_once` under the model's lock, again while events marked it dirty.
        False: collapsed into the pass already running or waiting (nothing was run)."""
        with self._guard:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = _Entry()
            elif collapsible:
                entry.dirty = True
                return False
            entry.users += 1
        try:
            with entry.lock:
                while True:
                    with self._guard:
                        entry.dirty = False
                    converge_once()
                    with self._guard:
                        # A pass waiting for the lock reads everything after us anyway.
                        if not entry.dirty or entry.users > 1:
                            break
        finally:
            with self._guard:
                entry.users -= 1
                if entry.users == 0:
                    del self._entries[key]
        return True


_locks = ModelLocks()


def backoff(retry: int) -> float:
    return float(min(MAX_BACKOFF_SECONDS, 5 * 2**retry))


@kopf.on.startup()
def configure(
    settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, **_: Any
) -> None:
    # Keep kopf's bookkeeping in our own annotations, and off the status we own.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    # No runtime CRD/namespace scanning: less RBAC (the CRD is installed before the operator).
    settings.scanning.disabled = True
    # Only warnings and errors become Events; our own Events say what changed. Otherwise
    # every handler run would post one (a write per resync).
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.execution.max_workers = HANDLER_THREADS
    if getattr(memo, "cluster", None) is None:
        memo.cluster = KubeCluster(_load_kube_config())
    if getattr(memo, "memory", None) is None:
        memo.memory = Memory()
    seconds = getattr(memo, "resync_seconds", None)
    seconds = DEFAULT_RESYNC_SECONDS if seconds is None else float(seconds)
    if seconds > 0:
        memo.resync = Resync(memo.cluster, memo.memory, seconds, logger)
        memo.resync.start()
    logger.info("sluice operator started", extra={"field_manager": "sluice-operator"})


@kopf.on.cleanup()
def stop_resync(memo: kopf.Memo, **_: Any) -> None:
    resync = getattr(memo, "resync", None)
    if resync is not None:
        resync.stop()


def _load_kube_config() -> Any:
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config()
        except config.ConfigException as exc:
            # Not retryable: without credentials the operator cannot do anything.
            raise kopf.PermanentError(
                f"no in-cluster config and no usable kubeconfig: {exc}"
            ) from None
    return client.ApiClient()


def _poster(body: Any) -> Any:
    def post(type_: str, reason: str, message: str) -> None:
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


def _converge(
    cluster: Cluster,
    memory: Memory,
    namespace: str,
    name: str,
    retry: int,
    logger: logging.Logger,
    collapsible: bool = False,
) -> None:
    """Converge one StreamingModel, read from memory under its lock.

    Handlers race (the create handler and the first child events arrive together); reading
    the object inside the lock, with the status the previous pass wrote (`Memory.wrote`),
    means each pass compares against that status, so it neither writes it again nor loses
    lastTransitionTime.
    """
    from kubernetes.client.exceptions import ApiException

    outcomes = []

    def converge_once() -> None:
        try:
            body = memory.model(namespace, name)
            if body is None or body["metadata"].get("deletionTimestamp"):
                return  # gone or going: the garbage collector removes the children
            check = _owner_check(cluster, body)
            outcomes.append(converge(cluster, body, _poster(body), reads=memory,
                                     owner_exists=check, pod_metrics=pod_metrics_page))  # fmt: skip
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

    _locks.run((namespace, name), converge_once, collapsible)
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


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
def reconcile(
    body: kopf.Body,
    namespace: str,
    name: str,
    memo: kopf.Memo,
    retry: int,
    logger: logging.Logger,
    **_: Any,
) -> None:
    _adopt_context(memo)
    _converge(memo.cluster, memo.memory, namespace, name, retry, logger)


def _adopt_context(memo: kopf.Memo) -> None:
    resync = getattr(memo, "resync", None)
    if resync is not None:
        resync.adopt_context()


def _converge_quietly(
    cluster: Cluster, memory: Memory, namespace: str, name: str, logger: logging.Logger, why: str
) -> None:
    """A pass nobody retries (child event, resync): errors are logged, never raised."""
    try:
        _converge(cluster, memory, namespace, name, 0, logger, collapsible=True)
    except kopf.PermanentError:
        pass  # already reported on the StreamingModel (status + Event)
    except kopf.TemporaryError as exc:
        # A watch event must never crash; the next event, the resync or the owner's handler
        # retries.
        logger.warning(f"converging {namespace}/{name} after {why} failed: {exc}")


def _owner_changed(
    body: kopf.Body,
    namespace: str | None,
    memo: kopf.Memo,
    logger: logging.Logger,
    event_type: str | None,
) -> None:
    _adopt_context(memo)
    meta = body.get("metadata", {})
    if event_type == "DELETED" and namespace:
        memo.memory.forget(body.get("kind", ""), namespace, meta.get("name", ""))
    owner = (meta.get("labels") or {}).get(INSTANCE_LABEL)
    if not owner or not namespace:
        return
    _converge_quietly(
        memo.cluster, memo.memory, namespace, owner, logger, f"a {event_type} child event"
    )


class Resync:
    """Every `seconds`, one collapsible pass per known model, from memory: a settled model
    costs no API call; a model whose last event-driven pass failed is converged again."""

    def __init__(self, cluster: Cluster, memory: Memory, seconds: float, logger: logging.Logger):
        self.cluster, self.memory, self.seconds, self.logger = cluster, memory, seconds, logger
        self.passes = 0
        self._context: contextvars.Context | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sluice-resync", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def adopt_context(self) -> None:
        """Keep a copy of a handler's context: kopf.event (the pass's Events) needs the
        operator's event queue, which kopf only puts into the context of its handlers."""
        if self._context is None:
            self._context = contextvars.copy_context()

    def run_once(self) -> None:
        self.memory.prune()
        models = self.memory.models()
        if self._context is None:
            return  # no handler has run yet: kopf is still listing, nothing to resync
        for namespace, name in models:
            if self._stop.is_set():
                return
            self._context.copy().run(
                _converge_quietly, self.cluster, self.memory, namespace, name, self.logger,
                "resync",
            )  # fmt: skip
            self.passes += 1
        self.logger.info(f"resync: {len(models)} models converged from memory")

    def _loop(self) -> None:
        while not self._stop.wait(self.seconds):
            try:
                self.run_once()
            except Exception:  # a bug in one pass must not end every later resync
                self.logger.exception("resync failed")


def _register_index(kind: Kind) -> None:
    """A kopf index of `kind` by (namespace, owner): filled from the watch's initial listing
    before any handler runs, then kept current by every event (DELETED drops the object)."""
    labels = None if kind is STREAMING_MODEL else OURS

    # async: runs on kopf's event loop at once, never queued behind passes for a worker thread
    async def index(body: kopf.Body, memo: kopf.Memo, **kwargs: Any) -> dict[Any, Any] | None:
        memory = getattr(memo, "memory", None)
        if memory is not None and not memory.attached:
            memory.attach(kwargs)
        key = index_key(kind, body)
        return {key: lean(body)} if key else None

    kopf.index(
        group=kind.group, version=kind.version, plural=kind.plural, labels=labels, id=kind.index_id
    )(index)


def _register_child_watches() -> None:
    for group, version, plural in CHILD_RESOURCES:

        def on_child(
            body: kopf.Body,
            namespace: str | None,
            memo: kopf.Memo,
            logger: logging.Logger,
            type: str | None,  # noqa: A002 - kopf's keyword
            **_: Any,
        ) -> None:
            _owner_changed(body, namespace, memo, logger, type)

        kopf.on.event(
            group=group, version=version, plural=plural, labels=OURS, id=f"child-{plural}"
        )(on_child)


for _kind in INDEXED_KINDS:
    _register_index(_kind)
_register_child_watches()
