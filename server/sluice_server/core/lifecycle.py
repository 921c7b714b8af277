"""Starting and finishing one stream: metrics, capacity slot, drain registry, token bill."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

from .events import DISCONNECTED, Meter
from .identity import Principal
from .metrics import bind
from .services import Services
from .stream import Stream
from .trail import Trail


def open_stream(
    svc: Services, trail: Trail, who: Principal, source: AsyncIterator, t0: float,
    prompt_tokens: Callable[[], int] = lambda: 0,
) -> tuple[Stream, Meter, Callable[[], None]]:  # fmt: skip
    """Start producing at once (the engine works while headers go out). The returned
    cleanup is idempotent and must run however the stream ends: it aborts an unfinished
    engine request, frees the slot and bills the caller's tokens. The stream's end also
    ends `trail` (its protocol and caller are the stream's)."""
    protocol = trail.protocol or ""
    trail.prompt_tokens = prompt_tokens
    trail.admitted_at = time.perf_counter()
    meter = Meter(bind(svc.metrics, protocol), t0, trail)
    s = svc.settings
    stream = Stream(source, cap=s.stream_buffer_tokens, timeout=s.stream_timeout_seconds)
    svc.gate.streams.add(stream)
    done = False

    def cleanup() -> None:
        nonlocal done
        if done:
            return
        done = True
        stream.close()
        svc.gate.streams.discard(stream)
        svc.gate.release()
        if meter.outcome is None:
            meter.finish(DISCONNECTED, stream)
        svc.bill(who, prompt_tokens() + meter.tokens)

    return stream, meter, cleanup
