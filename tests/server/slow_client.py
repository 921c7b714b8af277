"""Slow readers as a server meets them: raw sockets with a small receive buffer (set per
socket, SO_RCVBUF: nothing machine-wide), reading at a steady pace or not at all, for SSE
and WebSocket; and a server process on the simulator engine whose log the tests read (the
access log as JSON lines, uvicorn's and the server's own records).

The server runs in its own process, so what the kernel acknowledges is what the reader
took, whatever the server's event loop was doing; the readers run in the test's loop."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import socket
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from testkit.net import free_port, wait_http
from testkit.process import ManagedProcess
from testkit.wait import eventually_async

RCVBUF = 1024  # the kernel makes it about 2.3 KiB: the reader acknowledges in small steps
SIM = ("--engine", "simulator", "--model", "sim")
# The server with its listening socket's send buffer fixed (accepted sockets inherit it):
# a network path whose kernel buffer stays small, where a reader's backlog reaches the
# process soonest. Per socket, like the readers' receive buffers.
_WITH_SNDBUF = (
    "import socket, sys; from sluice_server.settings import parse_settings; "
    "from sluice_server.serve import serve; s = parse_settings(sys.argv[2:]); "
    "sock = socket.socket(); sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
    "sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, int(sys.argv[1])); "
    "sock.bind((s.host, s.port)); sys.exit(serve(s, sock))"
)
_PROBLEM = re.compile(r"\b(ERROR|CRITICAL)\b|Traceback \(most recent call last\)")


class SimServer:
    """`python -m sluice_server` on the simulator engine, its log in `log_dir`."""

    def __init__(self, log_dir: Path, *flags: str, sndbuf: int | None = None) -> None:
        self.port = free_port()
        args = [*SIM, "--host", "127.0.0.1", "--port", str(self.port),
                "--access-log-format", "json", *flags]  # fmt: skip
        head = ["-m", "sluice_server"] if sndbuf is None else ["-c", _WITH_SNDBUF, str(sndbuf)]
        self.proc = ManagedProcess(f"server-{self.port}", [sys.executable, *head, *args],
                                   log_dir, env=dict(os.environ))  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> SimServer:
        self.proc.start()
        wait_http(f"{self.url}/ready", timeout=60, process=self.proc)
        return self

    def __exit__(self, *exc) -> None:
        self.proc.stop()

    def lines(self) -> list[str]:
        return self.proc.log_path.read_text(errors="replace").splitlines()

    def access(self) -> list[dict]:
        return [json.loads(line) for line in self.lines()
                if line.startswith("{") and '"request_id"' in line]  # fmt: skip

    def problems(self) -> list[str]:
        """Error records and tracebacks: what operators alert on."""
        return [line for line in self.lines() if _PROBLEM.search(line)]

    async def wait_access(self, n: int, limit_s: float = 120) -> list[dict]:
        """The first `n` access-log lines, once the server has written them (fails at once
        if the server exited)."""

        def written() -> list[dict] | None:
            self.proc.check_alive()  # not retried: an exited server fails at once
            return lines if len(lines := self.access()) >= n else None

        def why() -> str:
            return f"{n} access-log lines\n{self.proc.tail()}"

        # A line the server is still writing does not parse yet.
        return await eventually_async(written, timeout=limit_s, interval=0.2, message=why,
                                      retry_on=(json.JSONDecodeError,))  # fmt: skip


def send_queues(port: int) -> list[int]:
    """Bytes in the kernel's send queue (unsent or unacknowledged) of each established
    IPv4 connection whose local address is 127.0.0.1:`port` (/proc/net/tcp: the server's
    sockets; another loopback address may serve the same port, as e2e pods do)."""
    local = f"0100007F:{port:04X}"  # 127.0.0.1, as /proc/net/tcp writes it (little-endian)
    queues = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == local and fields[3] == "01":
            queues.append(int(fields[4].split(":")[0], 16))
    return queues


async def connect(port: int, rcvbuf: int = RCVBUF) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: the window
    s.setblocking(False)
    await asyncio.get_running_loop().sock_connect(s, ("127.0.0.1", port))
    return s


async def post_stream(port: int, body: dict, path: str = "/v1/stream", rcvbuf: int = RCVBUF,
                      headers: str = "") -> socket.socket:  # fmt: skip
    """POST `body` as JSON; `headers`: extra header lines, each ending in CRLF."""
    s = await connect(port, rcvbuf)
    raw = json.dumps(body).encode()
    await asyncio.get_running_loop().sock_sendall(s, (
        f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n{headers}"
        f"Content-Length: {len(raw)}\r\n\r\n").encode() + raw)  # fmt: skip
    return s


async def open_ws(port: int, frames: list[dict], rcvbuf: int = RCVBUF,
                  headers: str = "") -> socket.socket:  # fmt: skip
    """A WebSocket handshake on /ws/stream, then (once accepted) `frames` sent as masked
    text frames. A refused handshake raises `Refused` with the server's answer."""
    loop = asyncio.get_running_loop()
    s = await connect(port, rcvbuf)
    key = base64.b64encode(os.urandom(16)).decode()
    await loop.sock_sendall(s, (
        f"GET /ws/stream HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
        f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
        f"Sec-WebSocket-Version: 13\r\n{headers}\r\n").encode())  # fmt: skip
    answer = b""
    while b"\r\n\r\n" not in answer:  # small: read it whole, byte by byte past its end
        chunk = await loop.sock_recv(s, 1)
        if not chunk:
            break
        answer += chunk
    if not answer.startswith(b"HTTP/1.1 101"):
        s.close()
        raise Refused(answer)
    await loop.sock_sendall(s, b"".join(map(_masked, frames)))
    return s


class Refused(Exception):
    """The server refused the WebSocket handshake; `args[0]` is the answer's head."""


def _masked(frame: dict) -> bytes:
    payload = json.dumps(frame).encode()
    mask = os.urandom(4)
    n = len(payload)
    head = bytes([0x81, 0x80 | n]) if n < 126 else bytes([0x81, 0x80 | 126]) + struct.pack("!H", n)
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


@dataclass
class Received:
    data: bytes = b""
    error: str | None = None  # how the connection ended, if not by the response's end
    stopped_at: float | None = None  # monotonic time the reader stopped reading

    def sse_events(self) -> list[dict]:
        """The response's SSE `data:` payloads (JSON), from its chunked body."""
        head, _, body = self.data.partition(b"\r\n\r\n")
        out, i = [], 0
        text = bytearray()
        while True:
            j = body.find(b"\r\n", i)
            if j < 0:
                break
            size = int(body[i:j], 16)
            if size == 0 or j + 2 + size > len(body):
                break
            text += body[j + 2 : j + 2 + size]
            i = j + 4 + size
        for line in text.decode(errors="replace").split("\n"):
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
        return out

    def ws_frames(self) -> list[dict]:
        """The server's text frames (JSON)."""
        rest = self.data
        out, i = [], 0
        while i + 2 <= len(rest):
            op, n = rest[i] & 0x0F, rest[i + 1] & 0x7F
            i += 2
            if n == 126:
                n, i = struct.unpack("!H", rest[i : i + 2])[0], i + 2
            elif n == 127:
                n, i = struct.unpack("!Q", rest[i : i + 8])[0], i + 8
            if i + n > len(rest):
                break
            if op == 1:
                out.append(json.loads(rest[i : i + n]))
            i += n
        return out


@dataclass
class Pace:
    """Read `rate` bytes/s on average (a late wake-up reads what it is owed), or stop
    reading for good after `stop_after` bytes (the socket stays open)."""

    rate: float
    stop_after: int | None = None
    step: int = field(default=0)

    def __post_init__(self) -> None:
        self.step = self.step or max(64, int(self.rate / 20))


async def read(s: socket.socket, pace: Pace, done, limit_s: float = 120) -> Received:
    """Read until `done(data)` says the response is complete, the server ends the
    connection, or `limit_s` passes."""
    loop = asyncio.get_running_loop()
    got = Received()
    data = bytearray()
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(limit_s):
            while True:
                if pace.stop_after is not None and len(data) >= pace.stop_after:
                    got.stopped_at = time.monotonic()
                    await _until_reset(s, limit_s)
                    got.error = "reset"
                    break
                owed = pace.rate * (time.monotonic() - t0) - len(data)
                if owed < pace.step:
                    await asyncio.sleep((pace.step - owed) / pace.rate)
                    continue
                want = int(owed)
                if pace.stop_after is not None:
                    want = min(want, pace.stop_after - len(data))
                chunk = await loop.sock_recv(s, max(1, min(want, 65536)))
                if not chunk:
                    got.error = "closed"
                    break
                data += chunk
                if done(data):
                    break
    except TimeoutError:
        got.error = "timeout"
    except ConnectionError as e:
        got.error = type(e).__name__
    finally:
        s.close()
    got.data = bytes(data)
    return got


async def _until_reset(s: socket.socket, limit_s: float) -> None:
    """Without reading, until the server resets the connection (TCP state leaves
    ESTABLISHED). `limit_s` is the caller's own limit, which started earlier and so ends
    first: the read then reports "timeout"."""
    await eventually_async(lambda: s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] != 1,
                           timeout=limit_s, interval=0.1,
                           message="the server to reset the connection")  # fmt: skip


def sse_done(data: bytes) -> bool:
    return data.endswith(b"0\r\n\r\n")


def ws_done(n: int):
    """The WebSocket has sent its final frame for each of `n` generations."""

    def done(data: bytes) -> bool:
        return data.count(b'"finished": true') >= n and data.endswith(b"}}")  # all of it

    return done
