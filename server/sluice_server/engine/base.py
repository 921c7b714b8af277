"""The engine seam: what the streaming routes need from a token generator.

Two implementations: the real vLLM `AsyncLLM` (engine/vllm_engine.py) and a simulator
with no model (engine/simulator.py) for load tests and rehearsals. Routes only see this.

The client APIs (OpenAI chat and completions, OpenAI Responses, Anthropic Messages, and
the utility routes: tokenize, detokenize, count_tokens, version) speak wire formats that
vLLM renders itself (chat templates, tools, parameter mapping, event shapes): each engine
hands them one `ApiServing` (`engine.api`), vLLM's own serving layer or a small built-in
formatter on the simulator, addressed by an `ApiKind`. One mechanism for every API: `parse`
a body into the engine's request object, `respond` with a whole reply or a stream. A
streamed answer comes back as a source of `Delta`s whose `text` is already-framed SSE, so
it flows through the same stream core as every other protocol.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Protocol, runtime_checkable

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    model_validator,
)


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

# A client's own `cache_salt` as vLLM accepts one (`validate_cache_salt`): 1-128 characters,
# none of `@`, `/`, `\`, NUL. The same rule as core/auth/cachesalt.py's `check_client_salt`,
# which checks the bodies vLLM's own request models read.
ClientSalt = Annotated[
    str, StringConstraints(min_length=1, max_length=128, pattern=r"^[^@/\\\x00]*$")
]


class Message(BaseModel):
    """One chat message as clients send it (OpenAI shape; content parts pass through)."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[Any] | None = None


def _prompt_or_messages_schema(schema: dict[str, Any]) -> None:
    """The JSON schema says what `PromptOrMessages` enforces: a string `prompt` or a
    non-empty `messages` array, exactly one of them, never null."""
    props = schema["properties"]
    props["prompt"] = {"type": "string", "title": "Prompt"}
    props["messages"] = {
        "type": "array",
        "items": props["messages"]["anyOf"][0]["items"],
        "minItems": 1,
        "title": "Messages",
    }
    schema["oneOf"] = [{"required": ["prompt"]}, {"required": ["messages"]}]


class PromptOrMessages(BaseModel):
    """A request body with exactly one of `prompt` or `messages` (chat, rendered with the
    model's template)."""

    model_config = ConfigDict(json_schema_extra=_prompt_or_messages_schema)
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _one_input(self) -> PromptOrMessages:
        for name in ("prompt", "messages"):
            if name in self.model_fields_set and getattr(self, name) is None:
                raise ValueError(f"`{name}` must not be null (leave it out instead)")
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` or `messages`")
        return self


@dataclass(slots=True)
class SamplingOptions:
    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False


@dataclass(frozen=True, slots=True)
class Adapter:
    """A LoRA adapter as the engine loads it: its served name, its folder on this machine
    (adapter_config.json + adapter_model.safetensors) and vLLM's integer LoRA id, which
    every API worker of a pod derives alike (core/adapters.py), so they all address one
    adapter in the shared engine core by one id."""

    name: str
    path: str
    lora_id: int


class AdapterLoadError(Exception):
    """The engine could not load an adapter; the message says why in a person's words."""


@dataclass(slots=True)
class StreamRequest:
    request_id: str
    # Exactly one of prompt / messages is set; messages are rendered with the chat template.
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    options: SamplingOptions = field(default_factory=SamplingOptions)
    # Set by engines that tokenize up front (`prepare`), so generate() needn't again.
    prompt_token_ids: list[int] | None = None
    # The caller's W3C trace headers, for engines that trace (vLLM with an OTLP endpoint).
    trace_headers: dict[str, str] | None = None
    # The caller's priority class as the engine's priority: 0 is the highest, larger runs
    # later (vLLM's `priority`, honoured with `--scheduling-policy priority`).
    priority: int = 0
    # A LoRA adapter to generate with (None: the base model).
    adapter: Adapter | None = None
    # vLLM's `cache_salt`: prompts with different salts share no cached prefix. The server
    # sets it from the caller's tenant and the client's own (core/auth/cachesalt.py).
    cache_salt: str | None = None
    # A continuation (core/streaming/continuation.py): the output token ids another replica
    # already generated. The engine generates after prompt + these, at most `max_tokens`
    # in all, and first yields one Delta replaying them (their text, `num_tokens` and
    # `completion_tokens` = their count); `prompt_tokens` stay the prompt's.
    resume_ids: list[int] | None = None
    # Disaggregated serving (core/kvtransfer.py): the connector's params for this request,
    # as vLLM's `SamplingParams.extra_args["kv_transfer_params"]` (a prefill's
    # `do_remote_decode`, or a decode's remote blocks). Only the routes set it.
    kv_transfer_params: dict[str, Any] | None = None


@dataclass(slots=True)
class Delta:
    """New output since the previous Delta of the same request (DELTA output kind)."""

    text: str
    num_tokens: int  # tokens in this delta (some decode to empty text)
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "abort" when finished
    prompt_tokens: int = 0
    completion_tokens: int = 0  # cumulative
    # Prompt tokens served from the prefix cache (vLLM's num_cached_tokens); None: the
    # engine does not report it.
    cached_tokens: int | None = None
    # The ids of this delta's tokens (None: not reported), for the event ids of streams the
    # router relays (core/streaming/continuation.py).
    token_ids: Sequence[int] | None = None
    # On the finished Delta of a request that asked for a remote decode: the params a
    # decode engine needs to fetch its KV cache (vLLM's `RequestOutput.kv_transfer_params`).
    kv_transfer_params: dict[str, Any] | None = None


ApiKind = Literal[
    "chat",  # OpenAI /v1/chat/completions
    "completion",  # OpenAI /v1/completions
    "responses",  # OpenAI /v1/responses
    "messages",  # Anthropic /v1/messages
    "count_tokens",  # Anthropic /v1/messages/count_tokens
    "tokenize",  # /tokenize
    "detokenize",  # /detokenize
]
# Kinds that generate (and may stream); the others answer at once from the tokenizer.
GENERATING: frozenset[str] = frozenset({"chat", "completion", "responses", "messages"})


class ApiRequestError(Exception):
    """The engine's serving layer refused the request before generating (a 4xx, or a 5xx
    for an internal failure), with its status, message and offending parameter."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


@dataclass(slots=True)
class ApiReply:
    """A whole (non-streamed) JSON answer and its usage (read from the answer's own
    `usage` fields by `usage_tokens`)."""

    body: dict[str, Any]
    status: int = 200
    prompt_tokens: int = 0
    completion_tokens: int = 0


def usage_tokens(body: dict[str, Any]) -> tuple[int, int]:
    """(prompt, completion) tokens from an answer's `usage`: OpenAI chat/completions name
    them `prompt_tokens`/`completion_tokens`, Responses and Anthropic Messages
    `input_tokens`/`output_tokens`. (0, 0) when the answer has no usage."""
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return 0, 0
    p = usage.get("prompt_tokens", usage.get("input_tokens")) or 0
    c = usage.get("completion_tokens", usage.get("output_tokens")) or 0
    return int(p), int(c)


@dataclass(slots=True)
class ApiStream:
    """A streamed answer: `chunks` yields Deltas whose text is framed SSE in the API's own
    event shapes (OpenAI chat/completions end with `data: [DONE]`); its last Delta is
    finished and carries the usage. `prompt_tokens` is the prompt's size as soon as it is
    known (for the rate limiter when the client leaves early)."""

    chunks: AsyncIterator[Delta]
    prompt_tokens: Callable[[], int]


class ApiServing(Protocol):
    """Every client API on one engine, addressed by `ApiKind`."""

    async def models(self) -> dict[str, Any]:
        """OpenAI's model list."""

    def version(self) -> dict[str, Any]:
        """`/version`: `{"version": ...}` of the engine that renders the APIs."""

    def parse(self, body: dict[str, Any], kind: ApiKind) -> Any:
        """The engine's request object; raises pydantic's ValidationError (a 400)."""

    async def respond(
        self,
        request: Any,
        kind: ApiKind,
        http_request: Any,
        priority: int = 0,
        resume: list[int] | None = None,
    ) -> ApiReply | ApiStream:
        """Start the request at the engine's `priority` (the caller's, never one the body
        or a header names): a reply, or a stream (when the request asked for one);
        ApiRequestError when the serving layer refuses it. Cancelling it aborts any
        engine work it started. With `resume` (a continuation, `StreamRequest.resume_ids`)
        the stream renders the whole answer as if these output tokens had just been
        generated, then the rest; its Deltas' `completion_tokens` count them too."""


@runtime_checkable
class Engine(Protocol):
    model_name: str
    max_model_len: int

    @property
    def api(self) -> ApiServing:
        """The client APIs (read-only: each engine holds its own `ApiServing`)."""

    def prepare(self, request: StreamRequest) -> int:
        """Render and tokenize before the 200 (sets `prompt_token_ids`), so an over-long
        prompt is a 400 and not an error event: ValueError when it is too long, any other
        exception when the chat template rejects the messages. Returns the token count."""

    def generate(self, request: StreamRequest) -> AsyncGenerator[Delta, None]:
        """Stream deltas, scheduled at `request.priority`. Closing/cancelling the generator
        must abort the request."""

    async def abort(self, request_id: str) -> None:
        """Stop a request at once; its iterator ends with finish_reason "abort"."""

    async def load_adapter(self, adapter: Adapter) -> None:
        """Load (or find already loaded) a LoRA adapter, so requests naming it, through
        `generate` or through `api`, use it; AdapterLoadError when it cannot be used."""

    async def unload_adapter(self, adapter: Adapter) -> None:
        """Forget an adapter: requests can no longer name it."""

    async def check_health(self) -> None:
        """Raise if the engine is dead (the server then reports 503 and /health fails)."""

    def num_unfinished_requests(self) -> int: ...

    async def shutdown(self) -> None: ...
