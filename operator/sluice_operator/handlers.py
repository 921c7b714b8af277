"""kopf handlers: thin. Each one reads the operator's runtime (`wiring.Runtime`) from kopf's
memo and runs a pass (`passes.Passes`), which calls `reconcile.converge` under the model's
lock and classifies what went wrong.

- StreamingModel created, changed (spec), or found at operator start -> converge; deleted
  -> the weights cache's commits it alone used are removed from the claim.
- A child (Deployment, Service, Ingress, HPA, PDB) or one of the pods changed or was
  deleted -> converge its owner: hand edits are put back, status follows the rollout.
- Every `--resync-seconds` -> converge every model (`resync.Resync`; a pass that failed
  after a child event is retried there); a settled model costs no API call.
Passes read the model, children and pods from memory (`cluster_view.ClusterView`): one kopf index per
kind in `kinds.INDEXED_KINDS`, filled by the watches kopf runs anyway, plus the operator's
own writes.

With `--leader-elect` (`election.Elector`), every replica watches and indexes, and only the
Lease holder writes: the model handlers are filtered (`when=`), child events and the resync
return early, every write goes through `cluster.FencedCluster`, kopf's own writes through
`kopfwrites.py`. A replica that becomes the leader converges every model from its warm
memory at once (`Resync.kick`).
"""

from __future__ import annotations

from typing import Any

import kopf

from .builders.common import INSTANCE_LABEL, MANAGED_BY_LABEL, MANAGER
from .cluster_view import index_key, lean
from .kinds import INDEXED_KINDS, STREAMING_MODEL, WATCHED_KINDS, Kind
from .kopfwrites import kopf_session
from .models import GROUP, PLURAL, VERSION
from .wiring import options_of, runtime_of, wire, wired

OURS = {MANAGED_BY_LABEL: MANAGER}
# (group, version, plural) of every child watch, from the one table of kinds.
# Two kinds may share a resource (the model's Service and its activator Service): one watch.
CHILD_RESOURCES = tuple(dict.fromkeys((k.group, k.version, k.plural) for k in WATCHED_KINDS))


def _leading_now(memo: kopf.Memo) -> bool:
    """The fence as kopf's session sees it: open until the runtime is wired (kopf sends no
    write of its own before its startup handlers ran), then the runtime's leadership."""
    runtime = wired(memo)
    return runtime is None or runtime.leading()


@kopf.on.login()
async def login(memo: kopf.Memo, logger: kopf.Logger, **kwargs: Any) -> Any:
    """kopf's own login, in a session that names this replica and refuses writes while it
    is not the leader (`kopfwrites.kopf_session`)."""
    info = kopf.login_via_client(logger=logger, **kwargs)
    if info is None:
        return None
    return kopf_session(info, options_of(memo).identity, lambda: _leading_now(memo))


@kopf.on.startup()
def configure(
    settings: kopf.OperatorSettings, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    """Wire the runtime (`wiring.wire`) from `run`'s options and start its threads."""
    memo.runtime = runtime = wire(options_of(memo), settings, logger)
    runtime.start()
    model_image = runtime.options.defaults.model_image  # of every model without spec.image
    key_file = runtime.options.continuation_key_file  # the path only, never the key
    logger.info(
        "sluice operator started",
        extra={
            "field_manager": "sluice-operator",
            "model_image": model_image,
            # None: no router model's streams migrate (condition StreamMigration says so).
            "continuation_key_file": str(key_file) if key_file else None,
        },
    )


@kopf.on.startup()
async def start_leader_election(memo: kopf.Memo, **_: Any) -> None:
    """With `--leader-elect`: campaign on kopf's loop, beside the watches."""
    runtime_of(memo).campaign()


@kopf.on.cleanup()
async def stop(memo: kopf.Memo, **_: Any) -> None:
    """Close the fence and release the Lease (a standby takes over at once), stop the resync."""
    runtime = wired(memo)
    if runtime is not None:
        await runtime.stop()


def _leading(memo: kopf.Memo, **_: Any) -> bool:
    """kopf filter of the model handlers: only the leader runs them."""
    return runtime_of(memo).leading()


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
    runtime = runtime_of(memo)
    runtime.resync.adopt_context()
    runtime.passes.converge(namespace, name, retry, logger)


@kopf.on.event(GROUP, VERSION, PLURAL, id="model-seen")
def model_seen(
    memo: kopf.Memo,
    body: kopf.Body,
    namespace: str | None,
    logger: kopf.Logger,
    type: str | None = None,  # noqa: A002 - kopf's keyword
    **_: Any,
) -> None:
    """kopf calls it once its listings are complete, also on a standby (whose model
    handlers are filtered out): from then on a takeover pass may run. A model deleted
    (DELETED: its last body) hands its weights back to the claim on the leader
    (`Passes.release_weights`); nothing else is written here."""
    runtime = runtime_of(memo)
    runtime.resync.adopt_context()
    if type == "DELETED" and namespace and runtime.leading():
        weights = (body.get("status") or {}).get("weights")
        if weights:
            runtime.passes.release_weights(namespace, dict(body), logger)


def _owner_changed(
    body: kopf.Body,
    namespace: str | None,
    memo: kopf.Memo,
    logger: kopf.Logger,
    event_type: str | None,
) -> None:
    runtime = runtime_of(memo)
    runtime.resync.adopt_context()
    meta = body.get("metadata", {})
    if event_type == "DELETED" and namespace:
        runtime.memory.forget(body.get("kind", ""), namespace, meta.get("name", ""))
    owner = (meta.get("labels") or {}).get(INSTANCE_LABEL)
    if not owner or not namespace or not runtime.leading():
        return
    runtime.passes.converge_quietly(namespace, owner, logger, f"a {event_type} child event")


def _register_index(kind: Kind) -> None:
    """A kopf index of `kind` by (namespace, owner): filled from the watch's initial listing
    before any handler runs, then kept current by every event (DELETED drops the object)."""
    labels = None if kind is STREAMING_MODEL else OURS

    # async: runs on kopf's event loop at once, never queued behind passes for a worker thread
    async def index(body: kopf.Body, memo: kopf.Memo, **kwargs: Any) -> dict[Any, Any] | None:
        runtime = wired(memo)
        if runtime is not None and not runtime.memory.attached:
            runtime.memory.attach(kwargs)
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
