"""Streams that outlive their pod, the router's reading of them (docs/migration.md): what
the client has received of a marked stream, and the continuation request that asks another
pod for the rest. Pure: bytes in, bytes out; the relay (proxy.py) does the I/O.

A pod that takes continuations marks the streams the router relays (its answer carries
`X-Sluice-Marked: 1`): each write of a stream ends with a frame that carries
`<stream>:<n>;<token ids>`, in the token stream's `id:` field or, on the APIs the engine
renders, in a `: sluice-id` comment line that opens the frame. These marks are the one
thing the router reads of a stream.

`Marks.take` passes on whole frames only, up to the end of the last marked frame (and the
keep-alive comments after it); the rest waits for the next read. So what the client has
received is always whole events, up to an event whose index and token ids the router knows:
a stream that breaks there is continued from the next event, with no event twice or
missing, and the seam leaves no half event open. A pod writes a whole frame at once and a
socket read almost always brings whole writes, so this holds nothing back in the common
case.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..core.auth.routerkey import model_key

# The final events: a stream that sent one is whole (nothing to continue).
_FINAL = (
    b"data: [DONE]\n\n",
    b"event: message_stop\n",
    b"event: response.completed\n",
    b"event: response.incomplete\n",
    b"event: response.failed\n",
)


class Marks:
    """What the client has received of one marked stream: the index of its last event
    (`index`, None before the first mark), the token ids that came with the events so far
    (`ids`, comma-joined decimal pieces, as the marks carry them), and the stream's name."""

    __slots__ = ("_marker", "_line", "_tail", "_last", "index", "ids", "stream")

    def __init__(self, token_sse: bool) -> None:
        self._marker = b"id: " if token_sse else b": sluice-id "
        self._line = b"\n" + self._marker  # the marker at a line's start
        self._tail = b""  # bytes received, not yet passed on (an unfinished frame)
        self.index: int | None = None
        self.ids: list[bytes] = []
        self.stream = b""
        self._last = b""  # the last bytes passed on

    def take(self, chunk: bytes) -> bytes:
        """What of `chunk` (after what was held) to pass to the client now."""
        data = self._tail + chunk if self._tail else chunk
        marker, line, size = self._marker, self._line, len(self._marker)
        upto = 0  # end of the last whole marked frame
        at = 0 if data.startswith(marker) else data.find(line) + 1 or -1
        while at >= 0:
            eol = data.find(b"\n", at)
            if eol < 0:
                break
            end = data.find(b"\n\n", eol)
            if end < 0:
                break
            self._read(data[at + size : eol])
            upto = end + 2
            at = data.find(line, upto - 1) + 1 or -1
        if data.startswith(b":", upto):
            upto = _comments_after(data, upto)
        if upto == len(data):
            self._tail = b""
            out = data
        else:
            self._tail = data[upto:]
            out = data[:upto]
        if out:
            self._last = out
        return out

    @property
    def finished(self) -> bool:
        """The protocol's final event went out (it is the last thing a stream sends)."""
        return any(final in self._last for final in _FINAL)

    def rest(self) -> bytes:
        """The held bytes, at the stream's clean end (an unmarked error event, say)."""
        tail, self._tail = self._tail, b""
        return tail

    def _read(self, value: bytes) -> None:
        """One mark, `<stream>:<n>;<ids>`, read from the right."""
        head, _, ids = value.rpartition(b";")
        stream, _, n = head.rpartition(b":")
        try:
            index = int(n)
        except ValueError:
            return  # not a mark the router knows: an older or newer pod's; passed unread
        self.index, self.stream = index, stream
        if ids:
            self.ids.append(ids)

    def received(self) -> int:
        """How many token ids the client has."""
        return sum(piece.count(b",") + 1 for piece in self.ids)


def _comments_after(data: bytes, upto: int) -> int:
    """`upto` moved past the whole comment-only frames that follow it (keep-alives: a
    held one would leave the client's proxy without its keep-alive)."""
    while data.startswith(b":", upto):
        end = data.find(b"\n\n", upto)
        if end < 0:
            break
        if any(not line.startswith(b":") for line in data[upto:end].split(b"\n")):
            break
        upto = end + 2
    return upto


def continuation_body(method: str, path: str, body: bytes, marks: Marks, token_sse: bool) -> bytes:
    """The body of `POST /internal/continue` for a stream broken after what `marks` holds:
    the original request (its JSON body as received, never parsed again), the token ids the
    client received, the next event's index and the stream's id and creation time."""
    assert marks.index is not None
    stream = marks.stream.decode("utf-8", "replace")
    created: int | None = None
    if not token_sse:  # the APIs' name is `<response id>@<created>` where they have a time
        rid, at, when = stream.rpartition("@")
        if at and when.isdigit():
            stream, created = rid, int(when)
    parts = [
        b'{"method":',
        json.dumps(method).encode(),
        b',"path":',
        json.dumps(path).encode(),
    ]
    if method != "GET":
        parts += [b',"body":', body]
    parts += [
        b',"token_ids":[',
        b",".join(marks.ids),
        b'],"next_event":%d,"response_id":' % (marks.index + 1),
        json.dumps(stream).encode(),
    ]
    if created is not None:
        parts.append(b',"created":%d' % created)
    parts.append(b"}")
    return b"".join(parts)


def busy(status: int, headers: Mapping[str, str]) -> bool:
    """A pod that cannot take a continuation now but may soon (at capacity, draining): 429,
    or 503 with Retry-After. Any other refusal is final (a 503 without it: the pod cannot
    read its key, say). `headers`: the answer's, case-insensitive."""
    return status == 429 or (status == 503 and "retry-after" in headers)


def key_for(master_file: Path, namespace: str, name: str) -> bytes:
    """The model's continuation key, from the master key file as it is now (a rotated
    Secret applies at the next continuation). OSError when it cannot be read."""
    master = master_file.read_bytes().split(b"\n", 1)[0]
    return model_key(master, namespace, name)


class Generation:
    """One generation on a relayed WebSocket: its generate frame, and what its client
    received (the token ids of its frames, the next frame's index)."""

    __slots__ = ("frame", "ids", "next")

    def __init__(self, frame: dict[str, Any]) -> None:
        self.frame = frame
        self.ids: list[bytes] = []
        self.next = 0

    def continuation(self) -> str:
        """Its generate frame with the `continuation` a second pod goes on from."""
        ids = [int(i) for piece in self.ids for i in piece.split(b",")]
        return json.dumps({**self.frame, "continuation": {"token_ids": ids,
                                                         "next_event": self.next}})  # fmt: skip


class Generations:
    """The unfinished generations of one relayed WebSocket whose pod marks its frames: each
    token frame and final frame starts with `"_sluice":"<n>;<token ids>",`, which `received`
    strips (the client never sees it) after noting it. Client frames are read for the
    generations they start and stop; a generation ends with its final frame or its error
    frame. A pod that does not mark (its first generation frame has no mark) leaves
    nothing to continue (`marking` False)."""

    def __init__(self) -> None:
        self.open: dict[Any, Generation] = {}
        self.marking: bool | None = None  # None: no generation frame seen yet
        self.last_at = time.monotonic()  # when the pod's last frame came
        self.seam: float | None = None  # a seam's start, until the next pod's first frame
        self.on_seam: Callable[[float], None] | None = None  # told the seam's gap

    def sent(self, text: str) -> None:
        """A client frame on its way to the pod."""
        try:
            frame = json.loads(text)
        except ValueError:
            return
        if not isinstance(frame, dict) or not isinstance(frame.get("id"), (str, int)):
            return
        if frame.get("type", "generate") == "generate" and "continuation" not in frame:
            self.open.setdefault(frame["id"], Generation(frame))

    def received(self, text: str) -> str:
        """A pod frame, its mark stripped and noted."""
        if self.marking is False:
            return text
        now = time.monotonic()
        if self.seam is not None:
            if self.on_seam is not None:
                self.on_seam(now - self.seam)
            self.seam = None
        self.last_at = now
        if text.startswith(_WS_MARK):
            end = text.find('",', len(_WS_MARK))
            if end < 0:
                return text
            mark, rest = text[len(_WS_MARK) : end], "{" + text[end + 2 :]
            self.marking = True
            k = rest.find('"index"')
            try:
                rid = json.loads(rest[6:k].rstrip(", "))
            except ValueError:
                return rest
            gen = self.open.get(rid)
            if gen is not None:
                n, _, ids = mark.partition(";")
                gen.next = int(n) + 1
                if ids:
                    gen.ids.append(ids.encode())
                if '"finished": true' in rest:
                    del self.open[rid]
            return rest
        if '"type": "queued"' in text or '"type":"queued"' in text:
            return text
        try:
            frame = json.loads(text)
        except ValueError:
            return text
        if isinstance(frame, dict):
            if "index" in frame and self.marking is None:
                self.marking = False  # an unmarked generation frame: a pod without the key
            if frame.get("type") == "error" or frame.get("finished") is True:
                self.open.pop(frame.get("id"), None)
        return text


_WS_MARK = '{"_sluice":"'
