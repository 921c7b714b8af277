"""The pieces of a continuation that need no server (core/streaming/continuation.py): the
event id's grammar, where a write's id goes, a frame's response id and time, and the
rewrite of a continuing replica's frames into the first stream's."""

from __future__ import annotations

import asyncio

from continuation_helpers import parse_id, split_name
from sluice_server.core.streaming.continuation import (
    Continuation,
    continued,
    event_id,
    frame_identity,
    stream_name,
    with_mark,
)
from sluice_server.engine.base import Delta


def test_an_event_id_reads_back_from_the_right():
    # A response id may hold ':' or '@' (vLLM takes a client's X-Request-Id).
    name = stream_name("chatcmpl-a:b@c", 1733350000)
    value = event_id(name, 7, [791, 3785])
    assert value == "chatcmpl-a:b@c@1733350000:7;791,3785"
    stream, n, ids = parse_id(value)
    assert (n, ids) == (7, [791, 3785])
    assert split_name(stream) == ("chatcmpl-a:b@c", 1733350000)
    assert parse_id(event_id("rid", 0, None)) == ("rid", 0, [])


def test_the_id_goes_on_the_last_frame_of_a_write():
    one = 'data: {"a":1}\n\n'
    assert with_mark(one, "s:0;1") == ': sluice-id s:0;1\ndata: {"a":1}\n\n'
    two = 'event: x\ndata: {"a":1}\n\ndata: [DONE]\n\n'
    marked = 'event: x\ndata: {"a":1}\n\n: sluice-id s:5;\ndata: [DONE]\n\n'
    assert with_mark(two, "s:5;") == marked


def test_a_frame_names_its_response_in_each_api():
    chat = 'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":5}\n\n'
    responses = 'event: response.created\ndata: {"response": {"id": "resp_1", "created_at": 6}}\n\n'
    messages = 'event: message_start\ndata: {"message": {"id": "msg_1"}}\n\n'
    assert frame_identity(chat) == ("chatcmpl-1", 5)
    assert frame_identity(responses) == ("resp_1", 6)
    assert frame_identity(messages) == ("msg_1", None)
    assert frame_identity("data: [DONE]\n\n") == (None, None)


def test_the_continuing_frames_become_the_first_streams():
    """The replay (completion tokens <= the received count) is dropped; what is kept takes
    the first stream's id and time, and Responses' sequence numbers go on from the events
    the client received (here 9, the replay rendered 5)."""

    def ev(seq: int, text: str = "") -> str:
        return (f'event: e\ndata: {{"type": "e", "sequence_number": {seq}, '
                f'"response": {{"id": "resp_new", "created_at": 2}}, "delta": "{text}"}}\n\n')  # fmt: skip

    async def source():
        yield Delta(ev(0) + ev(1), 0)  # the opening
        yield Delta(ev(2) + ev(3) + ev(4, "replayed"), 3, completion_tokens=3)
        yield Delta(ev(5, "new"), 1, completion_tokens=4)
        yield Delta("", 0, True, "stop", completion_tokens=4)

    async def run():
        cont = Continuation([1, 2, 3], 9, "resp_old", 1)
        return [d async for d in continued(source(), cont, framed=True)]

    kept = asyncio.run(run())
    assert [d.completion_tokens for d in kept] == [4, 4]
    text = kept[0].text
    assert '"sequence_number": 9' in text and "resp_old" in text and '"created_at": 1' in text
    assert "resp_new" not in text and "replayed" not in text
