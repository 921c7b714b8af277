"""Proof that a stream reaches a reader as it is sent, by holding the server's sends.

`HeldSends(app, holds)` is ASGI middleware on the server's side of a streamed answer (token
SSE `/v1/stream`, OpenAI `/v1/chat/completions`). It counts the token events the app sends
as the browser playground counts them (an event whose `token`, or whose first choice's
`delta.content`, is not empty) and records when each left (the server's clock). After the
send that carries token events for the n-th time, for each n in `holds`, it stops sending
and says how many token events it has sent (`held`, read from another thread); the reader's
side checks that it has shown every one of them and calls `release`. Holds count sends, not
events: a backlog that piled up during a hold may leave in one send (vLLM's OpenAI route
batches), and the next hold is still a later moment of the stream.

That turns "arrives incrementally" into a causal fact: the reader had event n before the
server sent event n + 1. No arrival timing is judged, so a loaded machine only makes the
proof slower: a proxy or page that buffers never shows the held events, however long it is
given, and its check fails (the negative control). A hold not released within `limit_s`
lets the stream go on, so a failed proof never wedges the server.

With `engine` (vLLM's `AsyncLLM`), the engine is paused for the length of each hold (its
`pause_generation(mode="keep")`: requests stay, nothing is scheduled) and resumed at the
release, so the stream does not run ahead while its sends wait. Without it, an idle
machine makes the tiny model's whole answer during the first holds, and the rest leaves in
one or two sends: a stream of a few sends has no later moment to hold at.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time

from testkit.wait import eventually_async

STREAM_PATHS = ("/v1/stream", "/v1/chat/completions")


def token_events(text: str) -> tuple[int, str]:
    """The token events in the complete SSE events of `text` and the incomplete rest."""
    text = text.replace("\r\n", "\n")
    *events, rest = text.split("\n\n")
    count = 0
    for event in events:
        lines = event.split("\n")
        if any(ln.startswith("event:") and ln[6:].strip() != "message" for ln in lines):
            continue  # an `event: error`: no token for the page
        data = "\n".join(ln[6:] if ln.startswith("data: ") else ln[5:]
                         for ln in lines if ln.startswith("data:"))  # fmt: skip
        if not data or data == "[DONE]":
            continue
        m = json.loads(data)
        choices = m.get("choices") or [{}]
        count += bool(m.get("token") or (choices[0].get("delta") or {}).get("content"))
    return count, rest


class HeldSends:
    """See the module docstring. `holds`: the token-carrying sends to hold after,
    ascending. One stream at a time."""

    def __init__(self, app, holds: list[int], limit_s: float = 60.0, engine=None) -> None:
        self.app, self.holds, self.limit_s, self.engine = app, sorted(holds), limit_s, engine
        self.sent: list[float] = []  # time.time() as each token event left
        self.sends = 0  # sends that carried token events
        self.held: queue.Queue[int] = queue.Queue()  # token events sent, at each hold
        self.released = [threading.Event() for _ in self.holds]
        self.timed_out: list[int] = []  # holds nobody released in time

    def release(self, index: int) -> None:
        self.released[index].set()

    def release_all(self) -> None:
        for event in self.released:
            event.set()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] not in STREAM_PATHS:
            return await self.app(scope, receive, send)
        rest = ""
        next_hold = 0

        async def held_send(message) -> None:
            nonlocal rest, next_hold
            await send(message)
            if message["type"] != "http.response.body":
                return
            n, rest = token_events(rest + message.get("body", b"").decode())
            if not n:
                return
            self.sent += [time.time()] * n
            self.sends += 1
            if next_hold < len(self.holds) and self.sends == self.holds[next_hold]:
                index, next_hold = next_hold, next_hold + 1
                try:
                    if self.engine is not None:
                        await self.engine.pause_generation(mode="keep", clear_cache=False)
                    self.held.put(len(self.sent))
                    await eventually_async(self.released[index].is_set, timeout=self.limit_s,
                                           interval=0.01, message="the reader's release")  # fmt: skip
                except AssertionError:
                    self.timed_out.append(self.holds[index])
                finally:
                    # Whatever ends the hold (a release, the reader gone, the server
                    # stopping): the shared engine runs again.
                    if self.engine is not None:
                        await asyncio.shield(self.engine.resume_generation())

        await self.app(scope, receive, held_send)
