"""Credentials out of log lines: uvicorn logs a refused WebSocket's request line with its
query string (`?api_key=...`, what browsers must use), and at debug uvicorn and websockets
log request headers (`authorization: Bearer ...`). A filter on the loggers that create those
records replaces the credential with `[redacted]` before any handler sees it.
"""

from __future__ import annotations

import logging
import re

# A query parameter that carries a credential, or a header that does.
CREDENTIAL = re.compile(
    r"(?P<q>[?&](?:api_key|access_token|token)=)[^&\s\"']+"
    r"|(?P<h>\b(?:authorization|x-api-key|proxy-authorization):\s*)[^\r\n\"']+",
    re.IGNORECASE,
)
LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "websockets", "websockets.server")


def redact(text: str) -> str:
    return CREDENTIAL.sub(lambda m: (m.group("q") or m.group("h")) + "[redacted]", text)


class RedactCredentials(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is the logging module's problem, not ours
            return True
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        return True


_FILTER = RedactCredentials()


def install() -> None:
    """Idempotent; call after uvicorn has configured its loggers (dictConfig keeps filters)."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
