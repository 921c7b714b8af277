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

With `--leader-elect` (`election.Elector`), every replica watches and indexes, and only the
Lease holder writes: the model handlers are filtered (`when=`), child events and the resync
return early, every write goes through `cluster.FencedCluster`, kopf's own annotation writes
through `_LeaderOnlyProgress`/`_LeaderOnlyDiffBase` and its Events are off. A replica that
becomes the leader converges every model from its warm memory at once (`Resync.kick`).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
from collections.abc import Callable
from typing import Any

import kopf

from . import __version__
from .builders.common import INSTANCE_LABEL, MANAGED_BY_LABEL, MANAGER
from .cluster import Cluster, FencedCluster, KubeCluster, KubeLeases, WriteFenced, pod_metrics_page
from .election import AlwaysLeading, ElectionSettings, Elector
from .kinds import DEPLOYMENT, INDEXED_KINDS, STREAMING_MODEL, WATCHED_KINDS, Kind
from .memory import Memory, index_key, lean
from .models import GROUP, PLURAL, VERSION
from .opmetrics import OperatorMetrics
from .pacing import RolloutPacer
from .reconcile import converge
from .scaler import ZeroScaler
from .scaletozero import ZeroContext
from .validation import SpecError

log = logging.getLogger("sluice_operator.handlers")
OURS = {MANAGED_BY_LABEL: MANAGER}
# (group, version, plural) of every child watch, from the one table of kinds.
# Two kinds may share a resource (the model's Service and its activator Service): one watch.
CHILD_RESOURCES = tuple(dict.fromkeys((k.group, k.version, k.plural) for k in WATCHED_KINDS))
MAX_BACKOFF_SECONDS = 300
ADAPTER_RECHECK_SECONDS = 10
# A LeaderWorkerSet rolling or starting: its status is read, not watched (`kinds.py`).
WORKLOAD_RECHECK_SECONDS = 10
DEFAULT_RESYNC_SECONDS = 300.0
DEFAULT_MAX_ROLLOUTS = 2
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


def user_agent(identity: str | None) -> str:
    """What every request of this replica carries, so an audit log tells replicas apart."""
    return f"sluice-operator/{__version__}" + (f" ({identity})" if identity else "")


def _leadership(memo: kopf.Memo) -> Any:
    return getattr(memo, "leadership", None) or AlwaysLeading()


def _leading(memo: kopf.Memo, **_: Any) -> bool:
    """kopf filter of the model handlers: only the leader runs them."""
    return bool(_leadership(memo).leading())


class _LeaderOnlyProgress(kopf.AnnotationsProgressStorage):
    """kopf's handler progress annotations, written only while this replica leads."""

    def __init__(self, leading: Callable[[], bool], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._leading = leading

    def store(self, **kwargs: Any) -> None:
        if self._leading():
            super().store(**kwargs)

    def purge(self, **kwargs: Any) -> None:
        if self._leading():
            super().purge(**kwargs)

    def touch(self, **kwargs: Any) -> None:
        if self._leading():
            super().touch(**kwargs)


class _LeaderOnlyDiffBase(kopf.AnnotationsDiffBaseStorage):
    """kopf's last-handled-configuration annotation, written only while this replica leads
    (a standby's skipped handlers would otherwise record the change as handled)."""

    def __init__(self, leading: Callable[[], bool], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._leading = leading

    def store(self, **kwargs: Any) -> None:
        if self._leading():
            super().store(**kwargs)


READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def _kopf_write_fence(memo: kopf.Memo) -> Callable[..., Any]:
    """An aiohttp client middleware for kopf's session: a write is refused (nothing sent)
    unless this replica leads. kopf composes its annotation patches and Events only while
    leading (the storages above, `posting.enabled`), but retries a request that failed
    (a connection cut, an apiserver 5xx) for up to a minute: without this, a patch composed
    before the Lease was lost could be sent again after a standby took over."""
    import aiohttp

    async def fence(request: Any, handler: Any) -> Any:
        if request.method not in READ_METHODS and not _leadership(memo).leading():
            raise aiohttp.ClientConnectionError(
                f"not the leader: {request.method} {request.url.path} not sent"
            )
        return await handler(request)

    return fence


@kopf.on.login()
async def login(memo: kopf.Memo, logger: kopf.Logger, **kwargs: Any) -> Any:
    """kopf's own login (the Kubernetes client's in-cluster config or kubeconfig), in an
    aiohttp session that sends our user agent (kopf's requests, watches, its annotations and
    Events, then name the replica in the audit log like the operator's own requests do) and
    refuses writes while this replica is not the leader (`_kopf_write_fence`)."""
    import aiohttp

    info = kopf.login_via_client(logger=logger, **kwargs)
    if info is None:
        return None
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, ssl=info.as_ssl_context()),
        headers={
            **info.as_http_headers(),
            "User-Agent": user_agent(getattr(memo, "identity", None)),
        },
        proxy=info.proxy_url,
        trust_env=info.trust_env,
        middlewares=(_kopf_write_fence(memo),),
    )
    return kopf.AiohttpSession(
        aiohttp_session=session,
        server=info.server,
        default_namespace=info.default_namespace,
        priority=info.priority,
        expiration=info.expiration,
    )


@kopf.on.startup()
def configure(
    settings: kopf.OperatorSettings, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    election: ElectionSettings | None = getattr(memo, "leader_election", None)

    def leading() -> bool:
        return bool(_leadership(memo).leading())

    # Keep kopf's bookkeeping in our own annotations, and off the status we own; written by
    # the leader only.
    settings.persistence.progress_storage = _LeaderOnlyProgress(leading, prefix=GROUP)
    settings.persistence.diffbase_storage = _LeaderOnlyDiffBase(
        leading, prefix=GROUP, key="last-handled-configuration"
    )
    # No runtime CRD/namespace scanning: less RBAC (the CRD is installed before the operator).
    settings.scanning.disabled = True
    # Only warnings and errors become Events; our own Events say what changed. Otherwise
    # every handler run would post one (a write per resync). A standby posts none.
    settings.posting.level = logging.WARNING
    settings.posting.enabled = election is None
    settings.watching.server_timeout = 300
    settings.execution.max_workers = HANDLER_THREADS
    if getattr(memo, "cluster", None) is None:
        api = _load_kube_config()
        api.user_agent = user_agent(getattr(memo, "identity", None))
        memo.kube = KubeCluster(api)
        memo.cluster = FencedCluster(memo.kube, leading)
    if getattr(memo, "memory", None) is None:
        memo.memory = Memory()
    seconds = getattr(memo, "resync_seconds", None)
    seconds = DEFAULT_RESYNC_SECONDS if seconds is None else float(seconds)
    memo.resync = Resync(memo.cluster, memo.memory, seconds, logger, leading=leading)
    limit = getattr(memo, "max_rollouts", None)
    memo.pacer = memo.resync.pacer = RolloutPacer(
        DEFAULT_MAX_ROLLOUTS if limit is None else int(limit),
        deployments=lambda: memo.memory.every(DEPLOYMENT),
        wake=memo.resync.converge_soon,
        models=memo.memory.models,
    )
    if election is not None and getattr(memo, "leadership", None) is None:

        def started() -> None:
            settings.posting.enabled = True
            memo.resync.kick()  # converge every model from memory now, not at the next resync

        def stopped(reason: str) -> None:
            settings.posting.enabled = False

        store = KubeLeases(memo.kube, election.namespace, election.name, election.renew_deadline)
        memo.leadership = Elector(election, store, on_started=started, on_stopped=stopped)
    if getattr(memo, "metrics", None) is None:
        memo.metrics = OperatorMetrics()
        port = getattr(memo, "metrics_port", None)
        if port:
            from prometheus_client import start_http_server

            host = getattr(memo, "metrics_host", None) or "0.0.0.0"
            start_http_server(int(port), addr=host, registry=memo.metrics.registry)
    if getattr(memo, "zero", None) is None:
        memo.zero = ZeroScaler(
            memo.cluster, memo.memory, getattr(memo, "activator", None),
            wake=memo.resync.converge_soon, page=pod_metrics_page, leading=leading,
            metrics=memo.metrics,
        )  # fmt: skip
    memo.resync.zero = memo.zero.context()
    memo.resync.start()
    memo.zero.start()
    logger.info("sluice operator started", extra={"field_manager": "sluice-operator"})


@kopf.on.startup()
async def start_leader_election(memo: kopf.Memo, **_: Any) -> None:
    """With `--leader-elect`: campaign on kopf's loop, beside the watches."""
    elector = getattr(memo, "leadership", None)
    if isinstance(elector, Elector) and getattr(memo, "election_task", None) is None:
        memo.election_task = asyncio.create_task(elector.run(), name="sluice-leader-election")


@kopf.on.cleanup()
async def stop(memo: kopf.Memo, **_: Any) -> None:
    """Close the fence and release the Lease (a standby takes over at once), stop the resync."""
    task = getattr(memo, "election_task", None)
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    resync = getattr(memo, "resync", None)
    if resync is not None:
        await asyncio.to_thread(resync.stop)
    zero = getattr(memo, "zero", None)
    if zero is not None:
        await asyncio.to_thread(zero.stop)


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


def _poster(body: Any, cluster: Cluster) -> Any:
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


def _converge(
    cluster: Cluster,
    memory: Memory,
    namespace: str,
    name: str,
    retry: int,
    logger: kopf.Logger,
    collapsible: bool = False,
    pacer: RolloutPacer | None = None,
    zero: ZeroContext | None = None,
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
            outcomes.append(
                converge(
                    cluster,
                    body,
                    _poster(body, cluster),
                    reads=memory,
                    owner_exists=check,
                    pacer=pacer,
                    pod_metrics=pod_metrics_page,
                    zero=zero,
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
    if not collapsible and any(o.workload_settling for o in outcomes):
        # No watch event follows the LeaderWorkerSet's status: read it again soon, until its
        # groups are updated and Ready (the status and a paced rollout's slot follow it).
        raise kopf.TemporaryError(
            "the LeaderWorkerSet's groups are not all updated and Ready yet",
            delay=WORKLOAD_RECHECK_SECONDS,
        )


@kopf.on.resume(GROUP, VERSION, PLURAL, when=_leading)
@kopf.on.create(GROUP, VERSION, PLURAL, when=_leading)
@kopf.on.update(GROUP, VERSION, PLURAL, when=_leading)
def reconcile(
    body: kopf.Body,
    namespace: str | None,
    name: str,
    memo: kopf.Memo,
    retry: int,
    logger: kopf.Logger,
    **_: Any,
) -> None:
    assert namespace is not None  # StreamingModels are namespaced
    _adopt_context(memo)
    pacer = getattr(memo, "pacer", None)
    _converge(memo.cluster, memo.memory, namespace, name, retry, logger, pacer=pacer,
              zero=_zero(memo))  # fmt: skip


def _zero(memo: kopf.Memo) -> ZeroContext | None:
    zero = getattr(memo, "zero", None)
    return zero.context() if zero is not None else None


def _adopt_context(memo: kopf.Memo) -> None:
    resync = getattr(memo, "resync", None)
    if resync is not None:
        resync.adopt_context()


@kopf.on.event(GROUP, VERSION, PLURAL, id="model-seen")
def model_seen(memo: kopf.Memo, **_: Any) -> None:
    """Writes nothing. kopf calls it once its listings are complete, also on a standby
    (whose model handlers are filtered out): from then on a takeover pass may run."""
    _adopt_context(memo)


def _converge_quietly(
    cluster: Cluster,
    memory: Memory,
    namespace: str,
    name: str,
    logger: kopf.Logger,
    why: str,
    pacer: RolloutPacer | None = None,
    zero: ZeroContext | None = None,
) -> None:
    """A pass nobody retries (child event, resync): errors are logged, never raised."""
    try:
        _converge(cluster, memory, namespace, name, 0, logger, collapsible=True, pacer=pacer,
                  zero=zero)  # fmt: skip
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
    logger: kopf.Logger,
    event_type: str | None,
) -> None:
    _adopt_context(memo)
    meta = body.get("metadata", {})
    if event_type == "DELETED" and namespace:
        memo.memory.forget(body.get("kind", ""), namespace, meta.get("name", ""))
    owner = (meta.get("labels") or {}).get(INSTANCE_LABEL)
    if not owner or not namespace or not _leadership(memo).leading():
        return
    _converge_quietly(
        memo.cluster, memo.memory, namespace, owner, logger, f"a {event_type} child event",
        getattr(memo, "pacer", None), _zero(memo),
    )  # fmt: skip


class Resync:
    """Every `seconds` (0: never), one collapsible pass per known model, from memory: a
    settled model costs no API call; a model whose last event-driven pass failed is
    converged again. `kick()` runs a round now: a replica that just became the leader.
    `converge_soon(keys)` converges just those models now: the pacer's waiting models when
    a rollout slot frees."""

    def __init__(
        self,
        cluster: Cluster,
        memory: Memory,
        seconds: float,
        logger: kopf.Logger,
        leading: Callable[[], bool] = lambda: True,
    ):
        self.cluster, self.memory, self.seconds, self.logger = cluster, memory, seconds, logger
        self.leading = leading
        self.pacer: RolloutPacer | None = None
        self.zero: ZeroContext | None = None
        self.passes = 0
        self._soon: set[tuple[str, str]] = set()
        self._soon_guard = threading.Lock()
        self._context: contextvars.Context | None = None
        self._missed = False  # a round was due before kopf's listings were complete
        self._all_due = False  # kick(): the next wake-up converges every model
        self._stop = threading.Event()
        self._kicked = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sluice-resync", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._kicked.set()
        self._thread.join(timeout=5)

    def kick(self) -> None:
        self._all_due = True
        self._kicked.set()

    def converge_soon(self, keys: list[tuple[str, str]]) -> None:
        with self._soon_guard:
            self._soon.update(keys)
        self._kicked.set()

    def _converge(self, namespace: str, name: str, why: str) -> None:
        assert self._context is not None
        self._context.copy().run(
            _converge_quietly, self.cluster, self.memory, namespace, name, self.logger, why,
            self.pacer, self.zero,
        )  # fmt: skip
        self.passes += 1

    def adopt_context(self) -> None:
        """Keep a copy of a handler's context: kopf.event (the pass's Events) needs the
        operator's event queue, which kopf only puts into the context of its handlers.
        kopf runs handlers only once every listing is complete, so from then on memory is
        whole; a round asked for before that (a Lease won during start-up) runs now."""
        if self._context is None:
            self._context = contextvars.copy_context()
            if self._missed:
                self.kick()

    def run_once(self) -> None:
        self.memory.prune()
        models = self.memory.models()
        if self._context is None:
            self._missed = True
            return  # no handler has run yet: kopf is still listing, nothing to resync
        done = 0
        for namespace, name in models:
            if self._stop.is_set() or not self.leading():
                break
            self._converge(namespace, name, "resync")
            done += 1
        if done:
            self.logger.info(f"resync: {done} models converged from memory")

    def _loop(self) -> None:
        timeout = self.seconds if self.seconds > 0 else None
        while not self._stop.is_set():
            woken = self._kicked.wait(timeout)
            self._kicked.clear()
            if self._stop.is_set():
                return
            every, self._all_due = self._all_due or not woken, False
            with self._soon_guard:
                soon, self._soon = sorted(self._soon), set()
            if not self.leading():
                continue
            try:
                if every:
                    self.run_once()
                elif soon and self._context is not None:
                    for namespace, name in soon:
                        self._converge(namespace, name, "a free rollout slot or a scale "
                                       "signal")  # fmt: skip
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
            logger: kopf.Logger,
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
