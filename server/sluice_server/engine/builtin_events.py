"""The built-in serving layer's streamed wire formats, one framer per API: OpenAI chat and
completions chunks, OpenAI Responses events, Anthropic Messages events.

Minimal but wire-correct: the event types, their order and the fields the official SDKs
read (vLLM's own server sends the same sequence for a plain text answer). A framer turns
the engine's deltas into framed SSE text: `opening()` at once, before the engine answers
(a Responses stream says `response.created` first, as vLLM does), `start(first_delta)`
once before the first text, `text()` per delta, and `end()` with the finishing delta (its
text, the finish reason and the usage).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from .base import Delta

_dumps = json.dumps


def usage_of(d: Delta | None) -> tuple[int, int]:
    return (d.prompt_tokens, d.completion_tokens) if d is not None else (0, 0)


def openai_usage(d: Delta | None) -> dict:
    """OpenAI chat and completions `usage`; `prompt_tokens_details.cached_tokens` when the
    engine reports its prefix-cache hits (as vLLM does with prompt token details on)."""
    p, c = usage_of(d)
    usage: dict = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
    if d is not None and d.cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": d.cached_tokens}
    return usage


class ChatFramer:
    """OpenAI chat (`chat.completion.chunk`) or completions (`text_completion`) chunks,
    then the optional usage chunk and `data: [DONE]`."""

    def __init__(self, rid: str, model: str, chat: bool, include_usage: bool) -> None:
        self.chat, self.include_usage, self.rid = chat, include_usage, rid
        self.obj = "chat.completion.chunk" if chat else "text_completion"
        self.head = (
            f'data: {{"id":"{rid}","object":"{self.obj}","created":{int(time.time())},'
            f'"model":{_dumps(model)},"choices":['
        )

    def _piece(self, text: str, reason: str | None) -> str:
        r = "null" if reason is None else _dumps(reason)
        if self.chat:
            return f'{self.head}{{"index":0,"delta":{{"content":{_dumps(text)}}},"finish_reason":{r}}}]}}\n\n'
        return f'{self.head}{{"index":0,"text":{_dumps(text)},"logprobs":null,"finish_reason":{r}}}]}}\n\n'

    def opening(self) -> str:
        return ""

    def start(self, d: Delta) -> str:
        if not self.chat:
            return ""
        return f'{self.head}{{"index":0,"delta":{{"role":"assistant","content":""}},"finish_reason":null}}]}}\n\n'

    def text(self, text: str) -> str:
        return self._piece(text, None)

    def end(self, d: Delta) -> str:
        out = self._piece(d.text, d.finish_reason)
        if self.include_usage:
            out += f'{self.head}],"usage":{_dumps(openai_usage(d))}}}\n\n'
        return out + "data: [DONE]\n\n"


def anthropic_usage(p: int, c: int, cached: int | None = None) -> dict:
    """Anthropic Messages `usage`: with cached prompt tokens, `input_tokens` counts only
    the others and `cache_read_input_tokens` the cached ones (as vLLM reports them)."""
    if cached is None:
        return {"input_tokens": p, "output_tokens": c}
    return {"input_tokens": max(0, p - cached), "output_tokens": c,
            "cache_read_input_tokens": cached}  # fmt: skip


def responses_usage(p: int, c: int, cached: int | None = None) -> dict:
    return {
        "input_tokens": p,
        "input_tokens_details": {"cached_tokens": cached or 0},
        "output_tokens": c,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": p + c,
    }


def response_object(
    rid: str, model: str, created: int, req: dict, status: str, output: list, usage: dict | None
) -> dict:
    """OpenAI's `response` object with the fields the SDK reads."""
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "model": model,
        "status": status,
        "output": output,
        "usage": usage,
        "error": None,
        "instructions": req.get("instructions"),
        "metadata": {},
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "temperature": req.get("temperature"),
        "top_p": req.get("top_p"),
        "max_output_tokens": req.get("max_output_tokens"),
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
    }


def response_status(finish_reason: str | None) -> str:
    """Cut short by `max_output_tokens`: "incomplete" (as vLLM and OpenAI say)."""
    return "incomplete" if finish_reason == "length" else "completed"


def message_item(item_id: str, text: str, status: str) -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content if status == "completed" else [],
    }


class ResponsesFramer:
    """OpenAI Responses events, each `event: <type>` with a `sequence_number`."""

    def __init__(self, rid: str, model: str, req: dict) -> None:
        self.rid, self.model, self.req = rid, model, req
        self.created = int(time.time())
        self.item = "msg_" + uuid.uuid4().hex
        self.seq = 0
        self.parts: list[str] = []

    def _ev(self, type_: str, **fields) -> str:
        data = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {type_}\ndata: {_dumps(data)}\n\n"

    def _where(self) -> dict:
        return {"item_id": self.item, "output_index": 0, "content_index": 0}

    def opening(self) -> str:
        """`response.created` and `response.in_progress`, sent before the first token."""
        r = response_object(self.rid, self.model, self.created, self.req, "in_progress", [], None)
        return self._ev("response.created", response=r) + self._ev(
            "response.in_progress", response=r
        )

    def start(self, d: Delta) -> str:
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return self._ev(
            "response.output_item.added",
            output_index=0,
            item=message_item(self.item, "", "in_progress"),
        ) + self._ev("response.content_part.added", **self._where(), part=part)

    def text(self, text: str) -> str:
        self.parts.append(text)
        return self._ev("response.output_text.delta", **self._where(), delta=text, logprobs=[])

    def end(self, d: Delta) -> str:
        out = self.text(d.text) if d.text else ""
        text = "".join(self.parts)
        item = message_item(self.item, text, "completed")
        usage = responses_usage(*usage_of(d), d.cached_tokens)
        final = response_object(
            self.rid,
            self.model,
            self.created,
            self.req,
            response_status(d.finish_reason),
            [item],
            usage,
        )
        return out + (
            self._ev("response.output_text.done", **self._where(), text=text, logprobs=[])
            + self._ev("response.content_part.done", **self._where(), part=item["content"][0])
            + self._ev("response.output_item.done", output_index=0, item=item)
            + self._ev("response.completed", response=final)
        )


STOP_REASONS = {"length": "max_tokens", "stop": "end_turn", "abort": "end_turn"}


class MessagesFramer:
    """Anthropic Messages events: `message_start`, one text block, `message_delta` with the
    stop reason and usage, `message_stop`."""

    def __init__(self, rid: str, model: str) -> None:
        self.rid, self.model = rid, model

    @staticmethod
    def _ev(type_: str, **fields) -> str:
        return f"event: {type_}\ndata: {_dumps({'type': type_, **fields})}\n\n"

    def opening(self) -> str:
        return ""

    def start(self, d: Delta) -> str:
        msg: dict[str, Any] = {
            "id": self.rid,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self.model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": d.prompt_tokens, "output_tokens": 0},
        }
        return self._ev("message_start", message=msg) + self._ev(
            "content_block_start", index=0, content_block={"type": "text", "text": ""}
        )

    def text(self, text: str) -> str:
        return self._ev("content_block_delta", index=0, delta={"type": "text_delta", "text": text})

    def end(self, d: Delta) -> str:
        p, c = usage_of(d)
        out = self.text(d.text) if d.text else ""
        delta = {
            "stop_reason": STOP_REASONS.get(d.finish_reason or "stop", "end_turn"),
            "stop_sequence": None,
        }
        return out + (
            self._ev("content_block_stop", index=0)
            + self._ev("message_delta", delta=delta, usage=anthropic_usage(p, c, d.cached_tokens))
            + self._ev("message_stop")
        )
