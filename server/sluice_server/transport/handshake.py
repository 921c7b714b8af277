"""A refused WebSocket handshake is an outcome, not an error.

The app refuses a handshake with a real HTTP status (the ASGI `websocket.http.response`
extension: 401, 403, 404, 429, 503, with the JSON error body), and the refusal has its
access-log line. uvicorn's default WebSocket protocol (websockets-sansio) never marks such
a handshake complete, so after every refusal it logs "ASGI callable returned without
completing handshake." at ERROR, which operators alert on. A filter on `uvicorn.error`
drops that one record, and only for a connection whose app sent the whole refusal: the
edge (`refused()`) sets a context variable in the connection's task when the refusal's
last body message went out, and uvicorn logs the record in that same task right after the
app returns. An app that returns without any answer is still logged. The message is
uvicorn's text: pinned with uvicorn in server/pyproject.toml, and
tests/server/test_client_outcomes.py fails when a refusal logs an error again.
"""

from __future__ import annotations

import contextvars
import logging

UNCOMPLETED = "ASGI callable returned without completing handshake."
_REFUSED: contextvars.ContextVar[bool] = contextvars.ContextVar("sluice_refused", default=False)


def refused() -> None:
    """The app sent a complete refusal of this connection's handshake."""
    _REFUSED.set(True)


class RefusalIsNoError(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == UNCOMPLETED and _REFUSED.get())


_FILTER = RefusalIsNoError()


def install() -> None:
    """Idempotent; call after uvicorn has configured its loggers (dictConfig keeps filters)."""
    logger = logging.getLogger("uvicorn.error")
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
