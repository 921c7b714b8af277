"""What clients normally do is an outcome, not an error: a reader cut off as stalled, a
client that disconnects (before the first token, mid-stream, by closing the socket or with
a WebSocket close frame), a refused WebSocket handshake. Each leaves one access-log line
with its outcome, and the server process's log holds no ERROR record and no traceback
(operators alert on those).

The server is a real process (`python -m sluice_server`, simulator engine, API keys, CORS,
a 1 s send timeout, its listening socket at a 64 KiB send buffer so a stalled reader is
felt soon); its whole output is read back."""

from __future__ import annotations

import asyncio
import os
import struct

import pytest
from slow_client import Pace, Refused, SimServer, open_ws, post_stream, read

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.slow]

KEY = "sk-outcomes"
LONG = {"prompt": "hi", "max_tokens": 4000, "ignore_eos": True}


def ws_headers(origin: str | None = None, key: str = KEY) -> str:
    extra = f"Authorization: Bearer {key}\r\n"
    return extra + (f"Origin: {origin}\r\n" if origin else "")


async def post(port: int, path: str, body: dict):
    return await post_stream(port, body, path, headers=f"Authorization: Bearer {KEY}\r\n")


async def take(s, n: int) -> None:
    """Read `n` bytes, then leave the socket to the caller."""
    loop, got = asyncio.get_running_loop(), 0
    while got < n:
        chunk = await loop.sock_recv(s, n - got)
        assert chunk, "the server closed early"
        got += len(chunk)


def generate(rid: str) -> dict:
    return {"id": rid, "prompt": "hi", "params": {"max_tokens": 4000, "ignore_eos": True}}


def close_frame() -> bytes:
    mask = os.urandom(4)
    payload = struct.pack("!H", 1000)
    return b"\x88\x82" + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


async def test_client_behaviour_is_an_outcome_never_an_error(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY}\n")
    flags = ("--api-key-file", str(keys), "--send-timeout-seconds", "1", "--sim-ttft-ms", "200",
             "--sim-itl-ms", "5", "--heartbeat-seconds", "120",
             "--cors-allowed-origins", "https://app.example.com")  # fmt: skip
    loop = asyncio.get_running_loop()
    chat = {"model": "sim", "stream": True, "max_tokens": 4000, "ignore_eos": True,
            "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    with SimServer(tmp_path, *flags, sndbuf=65536) as server:
        port, outcomes = server.port, []

        async def case(name: str, expected: str, run) -> None:
            """Run one client; once its access-log line is there, close what it left open."""
            left_open = await run()
            lines = await server.wait_access(len(outcomes) + 1)
            if left_open is not None:
                left_open.close()
            outcomes.append((name, expected, lines[-1]["outcome"], lines[-1]["status"]))

        def stalls(opening):
            async def run():
                s = await opening()
                await take(s, 2000)
                return s  # and reads no more

            return run

        def leaves(opening, first: int = 2000):
            async def run():
                s = await opening()
                await take(s, first)
                s.close()

            return run

        def sse():
            return post(port, "/v1/stream", LONG)

        def openai():
            return post(port, "/v1/chat/completions", chat)

        def ws(rid: str):
            return lambda: open_ws(port, [generate(rid)], headers=ws_headers())

        async def ws_sends_a_close_frame():
            s = await ws("c")()
            await take(s, 2000)
            await loop.sock_sendall(s, close_frame())
            got = await read(s, Pace(1 << 20), lambda d: False, limit_s=30)  # the server closes
            assert got.error in ("closed", "ConnectionResetError"), got.error

        def refused(origin: str | None, key: str, status: bytes):
            async def run():
                with pytest.raises(Refused) as answer:
                    await open_ws(port, [], headers=ws_headers(origin, key))
                assert answer.value.args[0].startswith(b"HTTP/1.1 " + status), answer.value

            return run

        await case("sse stalled", "stalled", stalls(sse))
        await case("websocket stalled", "stalled", stalls(ws("a")))
        await case("openai stalled", "stalled", stalls(openai))
        await case("sse left mid-stream", "disconnected", leaves(sse))
        # The first token comes after 200 ms; the client is gone before it.
        await case("sse left before the first token", "disconnected", leaves(sse, 0))
        await case("openai left mid-stream", "disconnected", leaves(openai))
        await case("websocket closed its socket", "disconnected", leaves(ws("b")))
        await case("websocket sent a close frame", "disconnected", ws_sends_a_close_frame)
        await case("websocket refused: bad key", "rejected", refused(None, "sk-wrong", b"401"))
        await case("websocket refused: origin", "rejected",
                   refused("https://evil.example", KEY, b"403"))  # fmt: skip
        problems = server.problems()
    print("\nRESULT " + "; ".join(f"{n}: {o} ({st})" for n, _, o, st in outcomes))
    assert problems == [], "\n".join(problems)
    assert [(n, o) for n, o, _, _ in outcomes] == [(n, e) for n, e, _, _ in outcomes], outcomes
