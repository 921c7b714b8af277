"""The engine seam: what the streaming routes need from a token generator.

Two implementations: the real vLLM `AsyncLLM` (engine/vllm_engine.py) and a simulator
with no model (engine/simulator.py) for load tests and rehearsals. Routes only see this.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


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


@dataclass(slots=True)
class Delta:
    """New output since the previous Delta of the same request (DELTA output kind)."""

    text: str
    num_tokens: int  # tokens in this delta (some decode to empty text)
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "abort" when finished
    prompt_tokens: int = 0
    completion_tokens: int = 0  # cumulative


@runtime_checkable
class Engine(Protocol):
    model_name: str
    max_model_len: int

    def generate(self, request: StreamRequest) -> AsyncIterator[Delta]:
        """Stream deltas. Closing/cancelling the iterator must abort the request."""

    async def abort(self, request_id: str) -> None:
        """Stop a request at once; its iterator ends with finish_reason "abort"."""

    async def check_health(self) -> None:
        """Raise if the engine is dead (the server then reports 503 and /health fails)."""

    def num_unfinished_requests(self) -> int: ...

    async def shutdown(self) -> None: ...
