"""Streams survive an extra hop: no hop-by-hop header set by the app on any streaming route,
and the framing holds end to end over HTTP/1.1 chunked and over an HTTP/2 hop.

A gateway with an endpoint picker (ext-proc) sits between client and pod, and a gateway
that copies a connection-specific header from an HTTP/1.1 upstream onto an HTTP/2 response
breaks the stream (HTTP/2 forbids them: RFC 9113 8.2.2; GAIE #2993 was a copied
`transfer-encoding` truncating `/v1/responses`). So the check is made where the headers are
born:

- what the app hands the server (`http.response.start`, recorded by an ASGI wrapper): no
  hop-by-hop header at all, on every streaming route (token SSE, chat, completions,
  Responses, Messages), with a negative control (the same app made to add one) that the
  check catches;
- the raw bytes the server sends: the only hop-by-hop header is the one HTTP/1.1 itself
  needs for a body of unknown length, `transfer-encoding: chunked`, once.

Then the framing: every event arrives whole and the stream ends with its terminator, read
as chunked HTTP/1.1 straight from the server and through nginx, and as HTTP/2 through nginx
(`listen ... http2`, client curl with nghttp2 and prior knowledge: h2c, as a gateway hop).
nginx strips hop-by-hop headers itself, so that hop alone proves nothing about the server:
the first two checks do. All on the simulator engine (same route layer as vLLM).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess

import httpx
import pytest
from app_helpers import free_port, serving, sse_events
from sluice_server.app import build_app
from sluice_server.engine.simulator import SimulatorEngine
from sluice_server.serve import uvicorn_config
from sluice_server.settings import Settings
from testkit.nginx_proxy import NginxProxy, find_nginx

pytestmark = pytest.mark.asyncio(loop_scope="session")

# RFC 9110 7.6.1 (Connection and the headers it names), RFC 9113 8.2.2 (forbidden in HTTP/2).
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-connection", "proxy-authenticate",
    "proxy-authorization", "te", "trailer", "transfer-encoding", "upgrade",
})  # fmt: skip
MESSAGES = [{"role": "user", "content": "hello river"}]
N = 12
# route -> (path, body, the last data line of a whole stream)
ROUTES = {
    "token-sse": ("/v1/stream", {"prompt": "hello river", "max_tokens": N}, "[DONE]"),
    "chat": ("/v1/chat/completions",
             {"messages": MESSAGES, "max_tokens": N, "stream": True}, "[DONE]"),
    "completions": ("/v1/completions",
                    {"prompt": "hello river", "max_tokens": N, "stream": True}, "[DONE]"),
    "responses": ("/v1/responses",
                  {"input": "hello river", "max_output_tokens": N, "stream": True}, None),
    "anthropic": ("/v1/messages",
                  {"model": "sim", "max_tokens": N, "messages": MESSAGES, "stream": True}, None),
}  # fmt: skip
LAST_EVENT = {"responses": "response.completed", "anthropic": "message_stop"}


def hop_headers(headers: list[tuple[bytes, bytes]]) -> list[str]:
    """The hop-by-hop headers in an ASGI header list (and any the Connection header names)."""
    names = [k.decode().lower() for k, _ in headers]
    named = {t.strip().lower() for k, v in headers if k.lower() == b"connection"
             for t in v.decode().split(",")}  # fmt: skip
    return [n for n in names if n in HOP_BY_HOP or n in named]


class RecordStarts:
    """ASGI wrapper: each response's `http.response.start` headers, by path."""

    def __init__(self, app, add: tuple[bytes, bytes] | None = None) -> None:
        self.app, self.add, self.starts = app, add, {}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def recording(message):
            if message["type"] == "http.response.start":
                if self.add is not None:  # the negative control: the app adds one
                    message = {**message, "headers": [*message["headers"], self.add]}
                self.starts[scope["path"]] = list(message["headers"])
            await send(message)

        return await self.app(scope, receive, recording)


@contextlib.asynccontextmanager
async def server(add: tuple[bytes, bytes] | None = None):
    port = free_port()
    settings = Settings(model="sim", engine="simulator", host="127.0.0.1", port=port,
                        log_level="warning")  # fmt: skip
    app = RecordStarts(build_app(settings, SimulatorEngine("sim", ttft_ms=5, itl_ms=2)), add)
    async with serving(uvicorn_config(settings, app)):
        yield f"http://127.0.0.1:{port}", app


def check_whole(route: str, events: list[dict]) -> None:
    """Every event parsed whole, the stream ended with its own terminator."""
    _, _, done = ROUTES[route]
    assert events, route
    for e in events[:-1] if done else events:
        json.loads(e["data"])  # a split or merged event fails to parse
    if done:
        assert events[-1]["data"] == done, route
    else:
        assert events[-1]["event"] == LAST_EVENT[route], (route, events[-1])


async def test_no_streaming_route_sets_a_hop_by_hop_header():
    async with server() as (url, app):
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            for route, (path, body, _) in ROUTES.items():
                check_whole(route, await sse_events(c, "POST", path, json=body))
                assert hop_headers(app.starts[path]) == [], (route, app.starts[path])
                ctype = dict(app.starts[path])[b"content-type"]
                assert ctype.startswith(b"text/event-stream"), (route, ctype)


@pytest.mark.parametrize("added", [(b"transfer-encoding", b"chunked"),
                                   (b"connection", b"keep-alive")],
                         ids=["transfer-encoding", "connection"])  # fmt: skip
async def test_negative_control_an_app_that_adds_one_is_caught(added):
    async with server(add=added) as (url, app):
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            path, body, _ = ROUTES["responses"]
            await sse_events(c, "POST", path, json=body)
    assert hop_headers(app.starts[path]) == [added[0].decode()]


async def _raw_head(url: str, path: str, body: dict) -> tuple[str, list[tuple[str, str]], bytes]:
    """Status line, headers and the rest as the server wrote them on the socket."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    payload = json.dumps(body).encode()
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
        + payload
    )
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(-1), 30)
    writer.close()
    head, _, rest = raw.partition(b"\r\n\r\n")
    status, *lines = head.decode().split("\r\n")
    return status, [tuple(x.strip() for x in line.split(":", 1)) for line in lines], rest


def _dechunk(data: bytes) -> bytes:
    out = b""
    while True:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            assert data == b"\r\n", data[:80]  # no trailers, the last chunk ends the body
            return out
        out, data = out + data[:size], data[size:]
        assert data[:2] == b"\r\n"
        data = data[2:]


@pytest.mark.parametrize("route", list(ROUTES))
async def test_on_the_wire_only_the_chunked_framing_http11_needs(route):
    path, body, _ = ROUTES[route]
    async with server() as (url, _):
        status, headers, rest = await _raw_head(url, path, body)
    assert status == "HTTP/1.1 200 OK"
    hop = [(k.lower(), v) for k, v in headers if k.lower() in HOP_BY_HOP]
    # `Connection: close` is the server answering our own request header, per RFC 9112 9.6.
    assert [h for h in hop if h != ("connection", "close")] == [("transfer-encoding", "chunked")]
    text = _dechunk(rest).decode()
    assert text.endswith("\n\n")  # the last event is whole


def _curl() -> str | None:
    curl = shutil.which("curl")
    if curl is None:
        return None
    features = subprocess.run([curl, "--version"], capture_output=True, text=True).stdout
    return curl if "HTTP2" in features else None


def _events(text: str) -> list[dict]:
    events = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        ev: dict = {}
        for line in block.split("\n"):
            if line.startswith(":") or not line:
                continue
            key, _, value = line.partition(":")
            value = value.removeprefix(" ")
            ev[key] = ev[key] + "\n" + value if key in ev else value
        if "data" in ev:
            events.append({"event": ev.get("event", "message"), "data": ev["data"]})
    return events


@pytest.mark.skipif(find_nginx() is None, reason="nginx not installed (apt-get install nginx)")
@pytest.mark.external
async def test_framing_end_to_end_over_http11_and_an_http2_hop():
    curl = _curl()
    if curl is None:
        pytest.skip("no curl with HTTP/2 (nghttp2) here")
    async with server() as (url, _):
        with NginxProxy(url, "ingress") as h1, NginxProxy(url, "ingress", http2=True) as h2:
            async with httpx.AsyncClient(base_url=h1.url, timeout=30) as c:
                for route, (path, body, _) in ROUTES.items():
                    check_whole(route, await sse_events(c, "POST", path, json=body))
            for route, (path, body, _) in ROUTES.items():
                out = await asyncio.to_thread(
                    subprocess.run,
                    [curl, "-sS", "-N", "--http2-prior-knowledge", "-D", "-",
                     "-H", "Content-Type: application/json", "--data", json.dumps(body),
                     "-w", "\n%{http_version}", h2.url + path],
                    capture_output=True, text=True, timeout=60,
                )  # fmt: skip
                assert out.returncode == 0, (route, out.stderr)
                text, _, version = out.stdout.rpartition("\n")
                assert version == "2", (route, version)
                head, _, stream = text.partition("\n\n")  # text mode: CRLF read as LF
                assert head.startswith("HTTP/2 200"), (route, head)
                names = {line.split(":", 1)[0].lower() for line in head.split("\n")[1:]}
                assert not names & HOP_BY_HOP, (route, head)
                check_whole(route, _events(stream))
