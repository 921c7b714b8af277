"""`run`: start kopf with our handlers against the current kubeconfig or in-cluster config."""

from __future__ import annotations

import logging

from .wiring import Options


def run(
    namespaces: list[str],
    all_namespaces: bool,
    liveness: str | None,
    options: Options,
    verbose: bool = False,
    standalone: bool = True,
    peering: str | None = None,
    log_format: str = "json",
) -> int:
    """`options`: what the handlers' runtime is built from (`wiring.wire`, at kopf's startup)."""
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
        memo=kopf.Memo(options=options),
    )
    return 0
