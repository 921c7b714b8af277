"""Process lifecycle: run uvicorn, and on SIGTERM drain instead of dropping streams.

SIGTERM (or the first SIGINT): `/ready` answers 503 at once and new streams are refused
(503 + Retry-After), while in-flight streams continue for up to --drain-timeout-seconds;
the rest are then ended with an error event. Only then is uvicorn told to exit, and the
process exits 0. A second signal skips the wait.
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn

from .app import build_app
from .core.trail import ACCESS_LOGGER
from .settings import Settings
from .transport import redact

log = logging.getLogger("sluice_server")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, settings: Settings) -> None:
        super().__init__(config)
        self.settings = settings
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame) -> None:  # called from the signal handler
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
        log.info("signal %s: draining (up to %gs for %d streams)",
                 sig, self.settings.drain_timeout_seconds, gate.active)  # fmt: skip
        cut = await gate.drain(self.settings.drain_timeout_seconds)
        log.info("drain done (%d streams cut off); shutting down", cut)
        self.should_exit = True


def uvicorn_config(settings: Settings, app) -> uvicorn.Config:
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        lifespan="on",
        ws_ping_interval=settings.heartbeat_seconds,
        ws_ping_timeout=settings.heartbeat_seconds,
        ws_max_size=settings.max_body_bytes,  # one limit for bodies and frames
        timeout_keep_alive=settings.keep_alive_seconds,
        timeout_graceful_shutdown=5,
        access_log=False,
    )
    redact.install()  # after the Config: it (re)configures uvicorn's loggers
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


def serve(settings: Settings) -> int:
    configure_logging(settings)
    config = uvicorn_config(settings, build_app(settings))
    server = DrainingServer(config, settings)
    server.run()
    # uvicorn returns normally after a signal-initiated shutdown; a failed start-up
    # (engine error in the lifespan) leaves `started` false.
    return 0 if server.started else 1
