"""Process lifecycle: run uvicorn, and on SIGTERM drain instead of dropping streams.

SIGTERM (or the first SIGINT): `/ready` answers 503 at once and new streams are refused
(503 + Retry-After), while in-flight streams continue for up to --drain-timeout-seconds;
the rest are then ended with an error event. Only then is uvicorn told to exit, and the
process exits 0. A second signal skips the wait.

A worker of a pod with several (`serve_worker`, started by `supervisor.py`) serves the
socket the supervisor bound, and drains the same way; there every signal after the first
is ignored (the supervisor forwards the pod's SIGTERM, and a terminal's Ctrl-C reaches the
whole process group too: one drain either way), and the supervisor owns "a second signal
skips the wait".
"""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing
import os
import socket
import sys
import threading
from multiprocessing import connection

import uvicorn

from .app import build_app, freeze_startup_heap
from .core.limits.shared_memory import PodSeat, PodState
from .core.telemetry.accesslog import ACCESS_LOGGER
from .router.app import Router, build_router
from .settings import RouterSettings, Settings
from .startup import phases
from .transport import handshake, redact

log = logging.getLogger("sluice_server")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, settings: Settings, escalate: bool = True) -> None:
        super().__init__(config)
        self.settings = settings
        self.escalate = escalate  # a second signal exits at once (one process per pod)
        self._drain_task: asyncio.Task | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:  # the lifespan opened the engine and the listener accepts
            phases.mark("serving")
            metrics = self.config.app.state.services.metrics  # type: ignore[union-attr]
            metrics.startup_phases(phases.ordered())
            log.info("start-up phases (seconds since the process started): %s", phases.summary())

    def handle_exit(self, sig: int, frame) -> None:  # called from the signal handler
        if self._drain_task is not None and not self.escalate:
            return  # a worker: already draining
        if self._drain_task is not None or not self.started:
            # Second signal, or not serving yet: exit now.
            return super().handle_exit(sig, frame)
        loop = asyncio.get_event_loop()
        loop.call_soon_threadsafe(self._start_drain, sig)

    def _start_drain(self, sig: int) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain(sig))

    async def _drain(self, sig: int) -> None:
        gate = self.config.app.state.services.gate  # type: ignore[union-attr]
        log.info(
            "signal %s: draining (up to %gs for %d streams)",
            sig,
            self.settings.drain_timeout_seconds,
            gate.active,
        )
        settings = self.settings
        handover = settings.handover_seconds if settings.continuation_key_file else None
        cut = await gate.drain(settings.drain_timeout_seconds, handover)
        log.info("drain done (%d streams cut off); shutting down", cut)
        self.should_exit = True


def uvicorn_config(settings: Settings | RouterSettings, app, **overrides) -> uvicorn.Config:
    """uvicorn's Config from the flags both processes share (the server and the router);
    `overrides` for what the router sets otherwise."""
    options = dict(
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        lifespan="on",
        ws_ping_interval=settings.heartbeat_seconds,
        ws_ping_timeout=settings.heartbeat_seconds,
        ws_max_size=settings.max_body_bytes,  # one limit for bodies and frames
        # uvicorn annotates an int but only hands it to loop.call_later: seconds as a float.
        timeout_keep_alive=settings.keep_alive_seconds,
        timeout_graceful_shutdown=5,
        access_log=False,  # it would log query strings (`?api_key=`)
    )
    config = uvicorn.Config(app, **{**options, **overrides})
    # After the Config: it (re)configures uvicorn's loggers.
    redact.install()
    handshake.install()
    return config


def configure_logging(settings: Settings) -> None:
    """Process logs at --log-level; the access log (one line per request) on its own
    handler at INFO whatever the log level, bare JSON lines with `--access-log-format json`.
    uvicorn's own access log stays off: it would log query strings (`?api_key=`)."""
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    access = logging.getLogger(ACCESS_LOGGER)
    access.propagate = False
    access.setLevel(logging.INFO if settings.access_log else logging.CRITICAL)
    handler = logging.StreamHandler()
    fmt = (
        "%(message)s" if settings.access_log_format == "json" else "%(asctime)s access %(message)s"
    )
    handler.setFormatter(logging.Formatter(fmt))
    access.addHandler(handler)


def serve(
    settings: Settings,
    sock: socket.socket | None = None,
    pod: PodSeat | None = None,
    engine_options: dict | None = None,
) -> int:
    """Serve until drained. A pod's worker passes the supervisor's listening socket, its
    seat and how to reach the pod's engine."""
    phases.mark("imports_done")
    configure_logging(settings)
    app = build_app(settings, pod=pod, engine_options=engine_options)
    server = DrainingServer(uvicorn_config(settings, app), settings, escalate=pod is None)
    server.run(sockets=[sock] if sock is not None else None)
    # uvicorn returns normally after a signal-initiated shutdown; a failed start-up
    # (engine error in the lifespan) leaves `started` false.
    return 0 if server.started else 1


def router_config(settings: RouterSettings, app) -> uvicorn.Config:
    return uvicorn_config(
        settings,
        app,
        # uvicorn's own wait for open connections: what held requests have, and 5 s more.
        timeout_graceful_shutdown=math.ceil(settings.drain_timeout_seconds) + 5,
        # A forwarded answer keeps the model server's own `date` and `server` (not two of each).
        server_header=False,
        date_header=False,
    )


def serve_router(settings: RouterSettings) -> int:
    """The router: one process (it only waits and relays). SIGTERM: new connections are
    refused, held requests wait at most `--drain-timeout-seconds` more, then uvicorn exits."""
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    app = build_router(settings)
    server = RouterServer(router_config(settings, app), app)
    server.run()
    return 0 if server.started else 1


class RouterServer(uvicorn.Server):
    """uvicorn's shutdown (stop listening, wait for open connections), with the held
    requests told first how long they may still wait (`Router.drain`); exit 0 after it,
    as the server's drain does. A second signal exits at once."""

    def __init__(self, config: uvicorn.Config, app: Router) -> None:
        super().__init__(config)
        self.app = app

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        freeze_startup_heap()  # what the imports and the lifespan made

    def handle_exit(self, sig: int, frame) -> None:  # called from the signal handler
        if self.started and not self.should_exit:
            asyncio.get_event_loop().call_soon_threadsafe(self.app.drain)
            self.should_exit = True  # exits 0 once drained (uvicorn re-raises only its own)
            return
        self.force_exit = True  # a second signal: no waiting
        super().handle_exit(sig, frame)


def serve_worker(
    settings: Settings,
    state: PodState,
    listen_address: str,
    sock: socket.socket,
    engine_args: object | None,
    client_config: dict,
) -> None:
    """One front-end worker process of a pod: the signature of vLLM's API-server target
    (`APIServerProcessManager(target_server_fn=...)`), with our settings and the pod's
    shared state bound in front. `engine_args` is vLLM's parsed arguments (None on the
    simulator: then each worker runs its own), `client_config` the worker's index and, on
    vLLM, its connection to the engine core."""
    index = client_config["client_index"]
    _exit_with_supervisor()
    options = {"client_config": client_config} if engine_args is not None else None
    log.info("worker %d of %d (pid %d) on %s", index, state.workers, os.getpid(), listen_address)
    sys.exit(serve(settings, _own_listener(sock), PodSeat(state, index), options))


def _own_listener(shared: socket.socket) -> socket.socket:
    """This worker's own listening socket on the supervisor's address (SO_REUSEPORT): the
    kernel then spreads new connections evenly over the workers. On the one shared socket
    (bound, never listened on: it reserves the port) every worker would wake for every
    connection, and whichever won took the whole queue, so a burst could land on one
    worker (measured: 12 of 12 concurrent streams, in one of a few runs)."""
    own = socket.socket(shared.family, socket.SOCK_STREAM)
    own.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    own.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    own.bind(shared.getsockname()[:2])
    shared.close()
    return own


def _exit_with_supervisor() -> None:
    """A worker whose supervisor is gone (killed outright) exits too, instead of serving
    on alone with nobody watching it."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        connection.wait([parent.sentinel])
        log.error("supervisor (pid %s) gone; worker exiting", parent.pid)
        os._exit(1)

    threading.Thread(target=watch, name="supervisor-watch", daemon=True).start()
