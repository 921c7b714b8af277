"""The engine seam: what the streaming routes need from a token generator.

Two implementations: the real vLLM `AsyncLLM` (engine/vllm_engine.py) and a simulator
with no model (engine/simulator.py) for load tests and rehearsals. Routes only see this.

The OpenAI routes speak OpenAI's wire format, which vLLM renders itself (chat templates,
tools, parameter mapping): each engine hands them an `OpenAIServing` (`engine.openai`):
vLLM's own serving layer, or a small built-in formatter on the simulator. Either way a
streamed answer comes back as a source of `Delta`s whose `text` is already-framed SSE, so
it flows through the same stream core as every other protocol.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, BeforeValidator, ConfigDict


def _flag(value: object) -> object:
    """A JSON boolean (or the query-string spellings `true`/`false`), not 0/1 or "yes"."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value in ("true", "false"):
        return value == "true"
    raise ValueError("must be a boolean (true or false)")


def not_a_flag(value: object) -> object:
    """A `mode="before"` field validator for numbers: pydantic's lax int and float would
    take true and false. (A validator, not an Annotated type: those lose the field's
    bounds in the JSON schema.)"""
    if isinstance(value, bool):
        raise ValueError("must be a number, not a boolean")
    return value


# Request fields that are switches: pydantic's lax bool would take 0, 1, "yes", "off".
Flag = Annotated[bool, BeforeValidator(_flag)]


class Message(BaseModel):
    """One chat message as clients send it (OpenAI shape; content parts pass through)."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[Any] | None = None


@dataclass(slots=True)
class SamplingOptions:
    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False


@dataclass(slots=True)
class StreamRequest:
    request_id: str
    # Exactly one of prompt / messages is set; messages are rendered with the chat template.
    prompt: str | None = None
    messages: list[dict] | None = None
    options: SamplingOptions = field(default_factory=SamplingOptions)
    # Set by engines that tokenize up front (`prepare`), so generate() needn't again.
    prompt_token_ids: list[int] | None = None
    # The caller's W3C trace headers, for engines that trace (vLLM with an OTLP endpoint).
    trace_headers: dict[str, str] | None = None


@dataclass(slots=True)
class Delta:
    """New output since the previous Delta of the same request (DELTA output kind)."""

    text: str
    num_tokens: int  # tokens in this delta (some decode to empty text)
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "abort" when finished
    prompt_tokens: int = 0
    completion_tokens: int = 0  # cumulative


OpenAIKind = Literal["chat", "completion"]


class OpenAIRequestError(Exception):
    """The engine's serving layer refused the request before generating (a 4xx, or a 5xx
    for an internal failure), with OpenAI's status, message and offending parameter."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


@dataclass(slots=True)
class OpenAIReply:
    """A whole (non-streamed) JSON answer and its usage."""

    body: dict
    status: int = 200
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(slots=True)
class OpenAIStream:
    """A streamed answer: `chunks` yields Deltas whose text is framed SSE (`data: ...\n\n`,
    ending with `data: [DONE]`); its last Delta is finished and carries the usage.
    `prompt_tokens` is the prompt's size as soon as it is known (for the rate limiter when
    the client leaves early)."""

    chunks: AsyncIterator[Delta]
    prompt_tokens: Callable[[], int]


class OpenAIServing(Protocol):
    """OpenAI's `/v1/models`, `/v1/chat/completions` and `/v1/completions` on one engine."""

    async def models(self) -> dict: ...

    def parse(self, body: dict, kind: OpenAIKind) -> Any:
        """The engine's request object; raises pydantic's ValidationError (a 400)."""

    async def respond(
        self, request: Any, kind: OpenAIKind, http_request: Any
    ) -> OpenAIReply | OpenAIStream:
        """Start the request: a reply, or a stream (when the request asked for one);
        OpenAIRequestError when the serving layer refuses it. Cancelling it aborts any
        engine work it started."""


@runtime_checkable
class Engine(Protocol):
    model_name: str
    max_model_len: int
    openai: OpenAIServing

    def prepare(self, request: StreamRequest) -> int:
        """Render and tokenize before the 200 (sets `prompt_token_ids`), so an over-long
        prompt is a 400 and not an error event: ValueError when it is too long, any other
        exception when the chat template rejects the messages. Returns the token count."""

    def generate(self, request: StreamRequest) -> AsyncIterator[Delta]:
        """Stream deltas. Closing/cancelling the iterator must abort the request."""

    async def abort(self, request_id: str) -> None:
        """Stop a request at once; its iterator ends with finish_reason "abort"."""

    async def check_health(self) -> None:
        """Raise if the engine is dead (the server then reports 503 and /health fails)."""

    def num_unfinished_requests(self) -> int: ...

    async def shutdown(self) -> None: ...
