"""The composition root: `run`'s options -> one typed `Runtime` the handlers share.

kopf hands every handler the same `memo`; this module is the only place that builds what
goes on it, and the handlers read it back through `runtime_of`, so a type checker sees the
seam between them (the collaborators, their types, who wakes whom):

- `cluster`: the API server (the kubeconfig's or in-cluster), every write behind the
  leader election's fence (`cluster.FencedCluster`);
- `memory`: what passes read, fed by kopf's indexes (`cluster_view.ClusterView`);
- `leadership`: the fence (`election.Elector` with `--leader-elect`, else `AlwaysLeading`);
- `resync`: the thread that converges every model on its period, or at once for a replica
  that just became the leader (`resync.Resync`);
- `pacer`: operator-caused rollouts, a few at a time; a freed slot wakes the resync;
- `zero`: the scale-to-zero poller; a changed signal wakes the resync;
- `metrics`: the operator's own Prometheus metrics;
- `key_file`: the router's master continuation key (`--continuation-key-file`), read by
  every pass and by the poller; a changed key wakes the resync;
- `passes`: one pass of one model under its lock, errors classified, with the operator's
  defaults for what a model leaves unset (`passes.Passes`, `models.resource.OperatorDefaults`).

kopf's own settings are set here too: its bookkeeping annotations and Events written by the
leader only (`kopfwrites.py`), no cluster scanning, and the handler thread pool.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import kopf

from .cluster import Cluster, FencedCluster, KubeCluster, KubeLeases, pod_metrics_page
from .cluster_view import ClusterView
from .continuationkey import ContinuationKeyFile
from .election import AlwaysLeading, ElectionSettings, Elector
from .kinds import DEPLOYMENT
from .kopfwrites import LeaderOnlyDiffBase, LeaderOnlyProgress, user_agent
from .modellocks import ModelLocks
from .models import GROUP
from .models.resource import OperatorDefaults
from .opmetrics import OperatorMetrics
from .pacing import RolloutPacer
from .passes import Passes
from .resync import Resync
from .scaletozero_poller import ActivatorSettings, ScaleToZeroPoller

DEFAULT_RESYNC_SECONDS = 300.0
DEFAULT_MAX_ROLLOUTS = 2
# Threads for the (sync) handlers. A pass mostly waits on the API server, and every child
# and pod event runs one: with kopf's default (CPUs + 4) a burst of child events kept new
# models waiting (50 models at once: last model's children 6.9-8.4 s, 5.3-5.9 s with 20).
HANDLER_THREADS = 20


@dataclass(frozen=True)
class Options:
    """What `run` was asked for, as far as the handlers are concerned."""

    resync_seconds: float = DEFAULT_RESYNC_SECONDS  # 0: no periodic resync
    max_rollouts: int = DEFAULT_MAX_ROLLOUTS  # 0: no limit
    identity: str | None = None  # in the user agent and the Lease holder identity
    election: ElectionSettings | None = None  # `--leader-elect`; None: one replica
    activator: ActivatorSettings | None = None  # None: no model is scaled to zero
    metrics_port: int = 0  # 0: no metrics endpoint
    metrics_host: str = "0.0.0.0"
    defaults: OperatorDefaults = OperatorDefaults()  # `--model-image`
    # `--continuation-key-file`: the router's master continuation key; None: no stream
    # migrates.
    continuation_key_file: Path | None = None


class Leadership(Protocol):
    def leading(self) -> bool: ...


@dataclass(frozen=True)
class Runtime:
    """The operator's collaborators, built once at startup by `wire`."""

    options: Options
    cluster: Cluster
    memory: ClusterView
    leadership: Leadership
    resync: Resync
    pacer: RolloutPacer
    zero: ScaleToZeroPoller
    metrics: OperatorMetrics
    passes: Passes
    elector: Elector | None = None  # the same object as `leadership` with `--leader-elect`
    key_file: ContinuationKeyFile | None = None  # `--continuation-key-file`
    _tasks: list[asyncio.Task[None]] = field(default_factory=list, repr=False)

    def leading(self) -> bool:
        return self.leadership.leading()

    def start(self) -> None:
        """The metrics endpoint and the two background threads (resync, scale to zero)."""
        if self.options.metrics_port:
            from prometheus_client import start_http_server

            start_http_server(
                self.options.metrics_port,
                addr=self.options.metrics_host or "0.0.0.0",
                registry=self.metrics.registry,
            )
        self.resync.start()
        self.zero.start()
        if self.key_file is not None:  # a rotated master key: every model's key anew
            self.key_file.watch(self.resync.kick)

    def campaign(self) -> None:
        """With `--leader-elect`: campaign on the running loop (kopf's), beside the watches."""
        if self.elector is not None and not self._tasks:
            task = asyncio.create_task(self.elector.run(), name="sluice-leader-election")
            self._tasks.append(task)

    async def stop(self) -> None:
        """Close the fence and release the Lease (a standby takes over at once), stop the
        resync and the scale-to-zero poller."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.to_thread(self.resync.stop)
        await asyncio.to_thread(self.zero.stop)
        if self.key_file is not None:
            await asyncio.to_thread(self.key_file.stop)


def wired(memo: Any) -> Runtime | None:
    """The runtime `wire` put on kopf's memo at startup; None before that."""
    runtime = getattr(memo, "runtime", None)
    return runtime if isinstance(runtime, Runtime) else None


def runtime_of(memo: Any) -> Runtime:
    """The runtime of a handler (kopf runs none before its startup handlers)."""
    runtime = wired(memo)
    if runtime is None:
        raise RuntimeError("the operator's runtime is not wired (its startup handler did not run)")
    return runtime


def options_of(memo: Any) -> Options:
    """What `run` put on kopf's memo (defaults when nothing was)."""
    options = getattr(memo, "options", None)
    return options if isinstance(options, Options) else Options()


def wire(
    options: Options,
    settings: kopf.OperatorSettings,
    logger: kopf.Logger,
    *,
    cluster: Cluster | None = None,
    memory: ClusterView | None = None,
    leadership: Leadership | None = None,
) -> Runtime:
    """Build the runtime and set kopf's `settings` for it; start nothing (`Runtime.start`).

    `cluster`, `memory`, `leadership`: stand-ins (tests); by default the API server of the
    kubeconfig or in-cluster config, an empty memory that kopf's indexes attach to, and the
    leader election of `options.election` (or always leading)."""
    kube: KubeCluster | None = None
    if cluster is None:
        api = _load_kube_config()
        api.user_agent = user_agent(options.identity)
        cluster = kube = KubeCluster(api)
    elector: Elector | None = None
    if leadership is None and options.election is not None:
        if kube is None:
            raise ValueError("leader election needs the API server's Lease, not a stand-in")
        elector = _elector(options.election, kube, settings, lambda: resync.kick())
        leadership = elector
    if leadership is None:
        leadership = AlwaysLeading()
    leading = leadership.leading
    _configure_kopf(settings, leading, electing=elector is not None)
    fenced = FencedCluster(cluster, leading)
    memory = memory if memory is not None else ClusterView()
    metrics = OperatorMetrics()

    def converge_quietly(namespace: str, name: str, why: str) -> None:
        passes.converge_quietly(namespace, name, logger, why)

    resync = Resync(
        memory,
        options.resync_seconds,
        logger,
        converge_quietly,
        leading=leading,
        after_round=lambda: passes.retry_releases(logger),
    )
    pacer = RolloutPacer(
        options.max_rollouts,
        deployments=lambda: memory.every(DEPLOYMENT),
        wake=resync.converge_soon,
        models=memory.models,
    )
    key_file = (
        ContinuationKeyFile(options.continuation_key_file)
        if options.continuation_key_file is not None
        else None
    )

    def operator_defaults() -> OperatorDefaults:
        return key_file.defaults(options.defaults) if key_file else options.defaults

    zero = ScaleToZeroPoller(
        fenced,
        memory,
        options.activator,
        wake=resync.converge_soon,
        page=pod_metrics_page,
        leading=leading,
        metrics=metrics,
        defaults=operator_defaults,
    )
    passes = Passes(
        fenced, memory, ModelLocks(), pacer, zero.context(), options.defaults, key_file=key_file
    )
    return Runtime(
        options=options,
        cluster=fenced,
        memory=memory,
        leadership=leadership,
        resync=resync,
        pacer=pacer,
        zero=zero,
        metrics=metrics,
        passes=passes,
        elector=elector,
        key_file=key_file,
    )


def _configure_kopf(
    settings: kopf.OperatorSettings, leading: Callable[[], bool], electing: bool
) -> None:
    # Keep kopf's bookkeeping in our own annotations, and off the status we own; written by
    # the leader only.
    settings.persistence.progress_storage = LeaderOnlyProgress(leading, prefix=GROUP)
    settings.persistence.diffbase_storage = LeaderOnlyDiffBase(
        leading, prefix=GROUP, key="last-handled-configuration"
    )
    # No runtime CRD/namespace scanning: less RBAC (the CRD is installed before the operator).
    settings.scanning.disabled = True
    # Only warnings and errors become Events; our own Events say what changed. Otherwise
    # every handler run would post one (a write per resync). A standby posts none.
    settings.posting.level = logging.WARNING
    settings.posting.enabled = not electing
    settings.watching.server_timeout = 300
    settings.execution.max_workers = HANDLER_THREADS


def _elector(
    election: ElectionSettings,
    kube: KubeCluster,
    settings: kopf.OperatorSettings,
    kick: Callable[[], None],
) -> Elector:
    """The leader election: kopf posts Events only while leading, and a replica that becomes
    the leader converges every model from memory now (`kick`), not at the next resync."""

    def started() -> None:
        settings.posting.enabled = True
        kick()

    def stopped(reason: str) -> None:
        settings.posting.enabled = False

    store = KubeLeases(kube, election.namespace, election.name, election.renew_deadline)
    return Elector(election, store, on_started=started, on_stopped=stopped)


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
