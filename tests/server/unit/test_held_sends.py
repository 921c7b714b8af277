"""held_sends.py, the browser proof's server side, without a browser or an engine: it counts
token events as the playground page does, and holds the app's sends until released."""

from __future__ import annotations

import asyncio
import json

from held_sends import HeldSends, token_events
from testkit.wait import eventually_async


def sse(data: str, sep: str = "\r\n", event: str | None = None) -> str:
    head = f"event: {event}{sep}" if event else ""
    return head + "".join(f"data: {line}{sep}" for line in data.split("\n")) + sep


def chunk(content: str | None) -> str:
    delta = {"role": "assistant"} if content is None else {"content": content}
    return json.dumps({"choices": [{"index": 0, "delta": delta}]})


def test_token_events_counts_what_the_page_shows():
    token = sse(json.dumps({"id": "r", "token": "a"}))
    empty = sse(json.dumps({"id": "r", "token": ""}))
    final = sse(json.dumps({"finished": True, "usage": {"completion_tokens": 2}}))
    multi = sse(json.dumps({"token": "b"}, indent=1))  # one event in several data: lines
    error = sse(json.dumps({"error": {"message": "x"}, "token": "c"}), event="error")
    assert token_events(token + empty + multi + final + error + sse("[DONE]")) == (2, "")
    openai = [chunk(None), chunk("hi"), chunk(""), chunk(" there"),
              json.dumps({"choices": [], "usage": {"completion_tokens": 2}}), "[DONE]"]  # fmt: skip
    assert token_events("".join(sse(c, sep="\n") for c in openai)) == (2, "")
    # An event split over two sends counts once, when it is complete.
    whole = sse(json.dumps({"token": "a"}))
    assert token_events(whole[:7]) == (0, whole[:7])
    assert token_events(whole[:7] + whole[7:]) == (1, "")


async def _app(scope, receive, send, n: int = 5, log: list | None = None) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    for i in range(n):
        if log is not None:
            log.append(i)
        await send({"type": "http.response.body", "more_body": True,
                    "body": sse(json.dumps({"token": str(i)})).encode()})  # fmt: skip
    await send({"type": "http.response.body", "body": b""})


async def _serve(held: HeldSends, path: str = "/v1/stream") -> list[dict]:
    out: list[dict] = []

    async def send(message) -> None:
        out.append(message)

    await held({"type": "http", "path": path}, None, send)
    return out


async def test_the_stream_waits_at_each_hold_until_released():
    log: list[int] = []
    held = HeldSends(lambda s, r, send: _app(s, r, send, log=log), [2, 4], limit_s=30)
    serving = asyncio.create_task(_serve(held))
    for index, want in enumerate([2, 4]):
        sent = await eventually_async(lambda: not held.held.empty() and held.held.get(),
                                      timeout=5, interval=0.01, message="a hold")  # fmt: skip
        assert sent == want and log == list(range(want))  # nothing more sent meanwhile
        await asyncio.sleep(0.05)  # (shows that nothing happens: still held)
        assert log == list(range(want)) and not serving.done()
        held.release(index)
    out = await asyncio.wait_for(serving, 5)
    assert len(held.sent) == 5 and held.timed_out == [] and out[-1]["body"] == b""


async def test_an_unreleased_hold_lets_the_stream_go_on_and_is_recorded():
    held = HeldSends(_app, [1], limit_s=0.2)
    await asyncio.wait_for(_serve(held), 5)
    assert held.timed_out == [1] and len(held.sent) == 5


async def test_holds_count_sends_that_carry_tokens_not_events():
    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for body in ("a", "b" * 2, ":ping", "c"):  # events per send: 1, 2, 0 (a ping), 1
            data = (
                "".join(sse(json.dumps({"token": t})) for t in body)
                if body[0] != ":"
                else body + "\r\n\r\n"
            )
            await send({"type": "http.response.body", "body": data.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    held = HeldSends(app, [2, 3], limit_s=30)
    serving = asyncio.create_task(_serve(held))
    for index, want in enumerate([3, 4]):  # after the 2nd and the 3rd token-carrying send
        got = await eventually_async(lambda: not held.held.empty() and held.held.get(),
                                     timeout=5, interval=0.01, message="a hold")  # fmt: skip
        assert got == want
        held.release(index)
    await asyncio.wait_for(serving, 5)
    assert held.sends == 3 and len(held.sent) == 4


async def test_other_paths_are_not_held():
    held = HeldSends(_app, [1], limit_s=30)
    await asyncio.wait_for(_serve(held, path="/v1/models"), 5)
    assert held.sent == [] and held.held.empty()


async def test_the_engine_is_paused_for_each_hold_and_resumed_at_its_release():
    class Engine:  # vLLM's AsyncLLM, as far as the holds use it
        def __init__(self) -> None:
            self.calls: list[str] = []

        async def pause_generation(self, *, mode: str, clear_cache: bool) -> None:
            self.calls.append(f"pause {mode} clear={clear_cache}")

        async def resume_generation(self) -> None:
            self.calls.append("resume")

    engine = Engine()
    held = HeldSends(_app, [1, 3], limit_s=30, engine=engine)
    serving = asyncio.create_task(_serve(held))
    for index in range(2):
        await eventually_async(lambda: not held.held.empty() and held.held.get(),
                               timeout=5, interval=0.01, message="a hold")  # fmt: skip
        assert engine.calls[-1] == "pause keep clear=False"  # paused while held
        held.release(index)
    await asyncio.wait_for(serving, 5)
    assert engine.calls == ["pause keep clear=False", "resume"] * 2
