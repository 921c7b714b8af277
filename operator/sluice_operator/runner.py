"""`run`: start kopf with our handlers against the current kubeconfig or in-cluster config."""

from __future__ import annotations

import logging


def run(
    namespaces: list[str],
    all_namespaces: bool,
    liveness: str | None,
    verbose: bool = False,
    standalone: bool = True,
    peering: str | None = None,
    log_format: str = "json",
    resync_seconds: float | None = None,
    identity: str | None = None,
    election: object | None = None,
    max_rollouts: int | None = None,
    activator: object | None = None,
    metrics_port: int = 0,
    metrics_host: str = "0.0.0.0",
) -> int:
    """`election`: `election.ElectionSettings` for `--leader-elect`, or None (one replica).
    `activator`: `scaler.ActivatorSettings` (`--activator-service`), or None: no model is
    scaled to zero."""
    import kopf

    from . import handlers  # noqa: F401 - registers the handlers with kopf's default registry

    fmt = {"json": kopf.LogFormat.JSON, "plain": kopf.LogFormat.PLAIN, "full": kopf.LogFormat.FULL}[
        log_format
    ]
    kopf.configure(verbose=verbose, log_format=fmt, log_refkey="object")
    logging.getLogger("kubernetes").setLevel(logging.WARNING)  # never echo requests (headers)
    kopf.run(
        clusterwide=all_namespaces or not namespaces,
        namespaces=namespaces,
        liveness_endpoint=liveness or None,
        standalone=standalone and not peering,
        peering_name=peering,
        memo=kopf.Memo(
            resync_seconds=resync_seconds,
            identity=identity,
            leader_election=election,
            max_rollouts=max_rollouts,
            activator=activator,
            metrics_port=metrics_port,
            metrics_host=metrics_host,
        ),
    )
    return 0
