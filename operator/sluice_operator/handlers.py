"""kopf handlers: thin. Each one calls `reconcile.converge` and classifies what went wrong.

- StreamingModel created, changed (spec), or found at operator start -> converge.
- A child (Deployment, Service, Ingress, HPA, PDB) or one of the pods changed or was
  deleted -> converge its owner: hand edits are put back, status follows the rollout.
No timers: they would put a finalizer on every StreamingModel (deletion would then hang
whenever the operator is down); the child watches make the operator event-driven.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import kopf

from .builders.common import INSTANCE_LABEL, MANAGED_BY_LABEL, MANAGER
from .cluster import Cluster, KubeCluster
from .kinds import STREAMING_MODEL, WATCHED_KINDS
from .models import GROUP, PLURAL, VERSION
from .reconcile import converge
from .validation import SpecError

OURS = {MANAGED_BY_LABEL: MANAGER}
# (group, version, plural) of every child watch, from the one table of kinds.
CHILD_RESOURCES = tuple((k.group, k.version, k.plural) for k in WATCHED_KINDS)
MAX_BACKOFF_SECONDS = 300


class _Entry:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0  # passes holding or waiting for the lock
        self.waiting = 0  # of those, passes not yet holding it


class ModelLocks:
    """One converge at a time per StreamingModel, bursts collapsed, memory bounded.

    Child events arrive in bursts (a rollout touches the Deployment, its pods and the
    ReplicaSet-driven status many times a second). A pass reads the model and its children
    fresh once it holds the lock, so while one pass is already queued behind the running one,
    another child event has nothing to add: it returns at once (`hold` yields False). At most
    one pass runs and one waits per model. The model's own handlers (create, update, resume)
    never skip: kopf retries them on failure, which a skipped pass would lose. An entry lives
    only while a pass holds or waits for it, so the table does not grow with every model ever
    seen (a deleted model leaves nothing behind).
    """

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._entries: dict[tuple[str, str], _Entry] = {}

    def __len__(self) -> int:
        with self._guard:
            return len(self._entries)

    @contextmanager
    def hold(self, key: tuple[str, str], collapsible: bool = False) -> Iterator[bool]:
        with self._guard:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = _Entry()
            skip = collapsible and entry.waiting > 0
            if not skip:
                entry.users += 1
                entry.waiting += 1
        if skip:
            yield False
            return
        try:
            with entry.lock:
                with self._guard:
                    entry.waiting -= 1
                yield True
        finally:
            with self._guard:
                entry.users -= 1
                if entry.users == 0:
                    del self._entries[key]


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
    if getattr(memo, "cluster", None) is None:
        memo.cluster = KubeCluster(_load_kube_config())
    logger.info("sluice operator started", extra={"field_manager": "sluice-operator"})


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


def _converge(
    cluster: Cluster,
    namespace: str,
    name: str,
    retry: int,
    logger: logging.Logger,
    collapsible: bool = False,
) -> None:
    """Converge one StreamingModel, read fresh under its lock.

    Handlers race (the create handler and the first child events arrive together); reading
    the object inside the lock means each pass compares against the status the previous
    pass wrote, so it neither writes it again nor loses lastTransitionTime.
    """
    from kubernetes.client.exceptions import ApiException

    with _locks.hold((namespace, name), collapsible) as run:
        if not run:
            return  # a pass already queued for this model reads everything fresh
        try:
            body = cluster.get(STREAMING_MODEL.api_version, STREAMING_MODEL.kind, namespace, name)
            if body is None or body["metadata"].get("deletionTimestamp"):
                return  # gone or going: the garbage collector removes the children
            outcome = converge(cluster, body, _poster(body))
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
    if outcome.applied or outcome.deleted or outcome.status_written:
        logger.info(
            f"converged: phase={outcome.phase} applied={outcome.applied} deleted={outcome.deleted}"
        )


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
    _converge(memo.cluster, namespace, name, retry, logger)


def _owner_changed(
    body: kopf.Body,
    namespace: str | None,
    memo: kopf.Memo,
    logger: logging.Logger,
    event_type: str | None,
) -> None:
    owner = (body.get("metadata", {}).get("labels") or {}).get(INSTANCE_LABEL)
    if not owner or not namespace:
        return
    try:
        _converge(memo.cluster, namespace, owner, 0, logger, collapsible=True)
    except kopf.PermanentError:
        pass  # already reported on the StreamingModel (status + Event)
    except kopf.TemporaryError as exc:
        # A watch event must never crash; the next event (or the owner's handler) retries.
        logger.warning(
            f"converging {namespace}/{owner} after a {event_type} child event failed: {exc}"
        )


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


_register_child_watches()
