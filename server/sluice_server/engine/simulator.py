"""A model-free engine: deterministic tokens on a configurable clock.

What it is for: load tests, ingress and autoscaling rehearsals on clusters without GPUs,
and fast unit tests of the streaming routes. It never stands in for the real engine in
proofs of behaviour.

Timing model (all on the event loop's monotonic clock, one timer per stream, no threads):

* Time to first token = ``ttft_ms + ttft_per_stream_ms * in_flight``, where ``in_flight``
  is the number of other unfinished requests when this one arrives at the same or a higher
  priority (``request.priority``, lower is higher: a priority scheduler's queue). This is the queueing
  model the TTFT autoscaler is rehearsed against: a real engine's TTFT grows with the number
  of streams it is already serving (prefill waits behind decode steps), so more load means
  higher TTFT, and more replicas bring it back down.
* Token ``i`` (0-based) is due at ``arrival + ttft + i * itl_ms``. Deadlines are absolute, so
  a late wake-up does not push every later token back (no drift). When a stream wakes up
  late and several tokens are already due, they go out as one Delta, as vLLM's output
  collector merges deltas for a consumer that falls behind.
* ``jitter`` is a relative standard deviation: each TTFT and each inter-token gap is
  multiplied by ``1 + jitter * N(0, 1)``, clipped to ``[max(0, 1 - 3 * jitter), 1 + 3 * jitter]``.
  The random stream is seeded per request, so a run is reproducible.

Prefix cache (off unless ``prefix_cache_blocks`` is set; `simcache.PrefixCache`): each
engine is one replica with an LRU of full blocks (``block_size`` tokens) keyed by vLLM's
block-hash chain of the prompt's token ids, its ``cache_salt`` and its adapter. A prompt's
leading cached blocks are its cached tokens (never its last token, as in vLLM), reported
in each Delta's ``cached_tokens`` (the OpenAI usage's ``prompt_tokens_details``); the
prompt's blocks enter the cache when its first token is due (prefill done), and prompt +
output blocks when it ends. TTFT gains ``prefill_us_per_token`` per uncached prompt token:
``ttft = (ttft_ms + ttft_per_stream_ms * in_flight + uncached * prefill_us_per_token)``
(times the jitter factor). With ``kv_events`` the cache's changes are published in vLLM's
KV-event format. Each request's prefill numbers are kept in ``prefills`` (the last 1,024).

Disaggregated serving (core/kvtransfer.py; on when ``kv_transfer`` is given, the
``--kv-transfer-config`` JSON): a request whose ``kv_transfer_params`` ask for a remote
decode (``do_remote_decode``) returns, on its finished Delta, NIXL-shaped params:
``remote_block_ids`` (one new id per full block of the prompt, never counting its last
token, which the decode side computes to sample its first token), ``remote_engine_id``
(the config's ``engine_id``, else a random id per engine), ``remote_host`` and
``remote_port`` (the config's ``kv_ip`` and ``kv_port``, vLLM's defaults
127.0.0.1:14579), ``remote_request_id`` and ``tp_size`` 1. A request that brings such params
(``do_remote_prefill``) counts those blocks' tokens as cached (no prefill time for them:
``prefill_us_per_token`` applies to the rest) and pays ``kv_transfer_us_per_block`` per
block instead (default 80 us: about one 16-token block of an 8B model's KV cache, 2 MiB,
over a 25 GB/s link). On such an engine ``cached_tokens`` is always a number (0 without
params and without a cache hit), as vLLM reports it with prompt token details on.

Tokens are words from a fixed list, cycled from an offset derived from the request's seed
(``options.seed``, else a CRC of the prompt): the same request gives the same text. A
continuation (``resume_ids``, core/streaming/continuation.py) replays as many words as it
names and goes on from the next position (it reads their count, not their values).
With ``stamp_tokens=True`` every token's text carries the wall-clock time it was due
(``" word@1732950000.123456"``): load generators on the same machine subtract it from their
arrival time to get the delivery lag through the server. The due time, not the wake-up
time, is the production time on purpose: a real engine runs in another process and keeps
producing while the server's event loop is busy, so event-loop lateness is delivery lag.

Stop strings are matched across token boundaries and are not included in the output; text
that could be the start of a stop string is held back until it is decided, like vLLM's
detokenizer does. ``eos_after_tokens`` (off by default) makes a request end on its own with
``finish_reason="stop"`` after that many tokens unless ``ignore_eos`` is set.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
import uuid
import zlib
from collections import deque
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..kvcache import blockhash
from .base import Adapter, AdapterLoadError, Delta, StreamRequest
from .builtin_api import BuiltinApi
from .simcache import EventPublisher, KvEventsConfig, PrefixCache

DEFAULT_WORDS: tuple[str, ...] = (
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while",
    "streams", "of", "tokens", "flow", "through", "sluice", "gates", "into", "calm",
    "water", "and", "every", "reader", "sees", "them", "arrive", "one", "by", "one", "now",
)  # fmt: skip


class EngineDeadError(RuntimeError):
    """The simulator was shut down; health checks fail and new requests are refused."""


@dataclass(slots=True)
class _Stream:
    """Per-request state the abort path needs: the pending wake-up and an abort flag."""

    aborted: bool = False
    waiter: asyncio.Future | None = None
    priority: int = 0
    # The request's `cache_salt` (vLLM's): the cached prefixes it may reuse are those of
    # requests with the same salt. Recorded as vLLM records it; the simulator caches nothing.
    cache_salt: str | None = None

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


@dataclass(frozen=True, slots=True)
class Prefill:
    """What the simulator decided for one request when it arrived."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float  # before jitter
    transferred_tokens: int = 0  # the cached tokens a remote prefill's blocks brought


def _word_id(word: str) -> int:
    """A word's token id (the prompt's and the output's words alike)."""
    return zlib.crc32(word.encode()) & 0x7FFF


def _release(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class SimulatorEngine:
    """Implements `sluice_server.engine.base.Engine` without a model."""

    def __init__(
        self,
        model_name: str = "simulator",
        *,
        ttft_ms: float = 50.0,
        itl_ms: float = 20.0,
        ttft_per_stream_ms: float = 0.0,
        jitter: float = 0.0,
        max_model_len: int = 4096,
        eos_after_tokens: int | None = None,
        stamp_tokens: bool = False,
        words: Sequence[str] = DEFAULT_WORDS,
        prefix_cache_blocks: int = 0,
        block_size: int = blockhash.DEFAULT_BLOCK_SIZE,
        prefill_us_per_token: float = 0.0,
        hash_algo: blockhash.HashAlgo = "sha256",
        kv_events: KvEventsConfig | None = None,
        kv_transfer: dict[str, Any] | None = None,
        kv_transfer_us_per_block: float = 80.0,
    ) -> None:
        if min(ttft_ms, itl_ms, ttft_per_stream_ms, jitter, prefill_us_per_token,
               kv_transfer_us_per_block) < 0:  # fmt: skip
            raise ValueError("simulator timings and jitter must be >= 0")
        if not words:
            raise ValueError("the simulator needs at least one word")
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.ttft_s = ttft_ms / 1000.0
        self.itl_s = itl_ms / 1000.0
        self.ttft_per_stream_s = ttft_per_stream_ms / 1000.0
        self.jitter = jitter
        self.eos_after_tokens = eos_after_tokens
        self.stamp_tokens = stamp_tokens
        # Leading space: tokens concatenate into readable text, as BPE word pieces do.
        self._words = tuple(" " + w for w in words)
        self._word_ids = tuple(_word_id(w) for w in words)
        self._streams: dict[str, _Stream] = {}
        self._dead = False
        self.adapters: dict[str, Adapter] = {}
        self.api = BuiltinApi(model_name, self)
        self.prefill_s_per_token = prefill_us_per_token / 1e6
        self.prefills: deque[Prefill] = deque(maxlen=1024)
        self.block_size = block_size
        self.kv_transfer = kv_transfer
        self.transfer_s_per_block = kv_transfer_us_per_block / 1e6
        self.engine_id = str((kv_transfer or {}).get("engine_id") or uuid.uuid4())
        self._next_block = 0
        self.cache: PrefixCache | None = None
        if kv_events is not None and not prefix_cache_blocks:
            raise ValueError("simulator KV events need a prefix cache (prefix_cache_blocks)")
        if prefix_cache_blocks:
            # The engine's NONE_HASH seed rule (PYTHONHASHSEED, else vLLM's default).
            hasher = blockhash.BlockHasher(
                hash_algo, blockhash.none_hash_seed(hash_algo, os.environ), block_size
            )
            publisher = EventPublisher(kv_events) if kv_events is not None else None
            self.cache = PrefixCache(prefix_cache_blocks, hasher, publisher)

    # -- Engine protocol -------------------------------------------------------------

    def prepare(self, request: StreamRequest) -> int:
        """Count and check the prompt before the 200, as the vLLM adapter does, so an
        over-long prompt is a 400 and not an error event. Prompt tokens are the prompt's
        whitespace-separated words (their ids are stable hashes; nothing reads them)."""
        words = self._prompt_text(request).split() or [""]
        if len(words) >= self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens; "
                f"the prompt has {len(words)} tokens."
            )
        request.prompt_token_ids = [_word_id(w) for w in words]
        return len(words)

    def generate(self, request: StreamRequest) -> AsyncGenerator[Delta, None]:
        return self._generate(request)

    async def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.aborted = True
            stream.wake()

    async def load_adapter(self, adapter: Adapter) -> None:
        """No weights to apply: the folder must hold a PEFT adapter config with a rank (so a
        broken adapter fails here as it would on vLLM); its answers differ from the base's."""
        config = Path(adapter.path) / "adapter_config.json"
        try:
            rank = json.loads(config.read_text()).get("r")
        except (OSError, ValueError) as e:
            raise AdapterLoadError(
                f"no usable adapter_config.json in {adapter.path}: {type(e).__name__}: {e}"
            ) from None
        if not isinstance(rank, int) or rank < 1:
            raise AdapterLoadError(f"{config}: `r` (the rank) must be a positive integer")
        self.adapters[adapter.name] = adapter

    async def unload_adapter(self, adapter: Adapter) -> None:
        self.adapters.pop(adapter.name, None)

    async def check_health(self) -> None:
        if self._dead:
            raise EngineDeadError("simulator engine is shut down")

    def num_unfinished_requests(self) -> int:
        return len(self._streams)

    def prefix_cache(self) -> tuple[dict[str, Any], Path | None]:
        """How a router hashes this engine's prompts (`kvcache/describe.py`): the prompt's
        whitespace words (`prepare`), the cache's block size, hash and seed."""
        hasher = self.cache.hasher if self.cache is not None else None
        algo = hasher.algo if hasher is not None else "sha256"
        return {
            "enabled": hasher is not None,
            "block_size": hasher.block_size if hasher is not None else blockhash.DEFAULT_BLOCK_SIZE,
            "hash_algo": algo,
            "none_hash_seed": hasher.seed if hasher is not None else None,
            "loras": {a.name: str(a.path) for a in self.adapters.values()},
            "tokenizer": {"kind": "words"},
        }, None

    async def shutdown(self) -> None:
        self._dead = True
        for stream in list(self._streams.values()):
            stream.aborted = True
            stream.wake()
        if self.cache is not None and self.cache.publisher is not None:
            self.cache.publisher.close()

    # -- internals -------------------------------------------------------------------

    def _factor(self, rng: random.Random | None) -> float:
        if rng is None or not self.jitter:
            return 1.0
        lo, hi = max(0.0, 1.0 - 3.0 * self.jitter), 1.0 + 3.0 * self.jitter
        return min(hi, max(lo, 1.0 + self.jitter * rng.gauss(0.0, 1.0)))

    @staticmethod
    def _prompt_text(request: StreamRequest) -> str:
        if request.prompt is not None:
            return request.prompt
        parts = []
        for message in request.messages or []:
            content = message.get("content")
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):  # OpenAI content parts
                parts.extend(p.get("text", "") for p in content if isinstance(p, dict))
        return "\n".join(parts)

    async def _generate(self, request: StreamRequest) -> AsyncGenerator[Delta, None]:
        if self._dead:
            raise EngineDeadError("simulator engine is shut down")
        rid = request.request_id
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already running")
        opts = request.options
        prompt = self._prompt_text(request)
        if request.prompt_token_ids is None:
            self.prepare(request)
        ids = request.prompt_token_ids or []
        prompt_tokens = len(ids)
        max_tokens = min(opts.max_tokens, self.max_model_len - prompt_tokens)
        eos_at = None if opts.ignore_eos else self.eos_after_tokens
        seed = opts.seed if opts.seed is not None else zlib.crc32(prompt.encode())
        if request.adapter is not None:  # an adapter's answer differs from the base's
            seed += zlib.crc32(request.adapter.name.encode())
        # A Mersenne Twister is 2.5 KB per stream: only jittered timing needs one.
        rng = random.Random(seed) if self.jitter else None
        words, nwords = self._words, len(self._words)
        offset = seed % nwords
        stops = [s for s in opts.stop if s]
        holdback = max((len(s) for s in stops), default=1) - 1

        loop = asyncio.get_running_loop()
        wall_offset = time.time() - loop.time()
        priority = request.priority
        in_flight = 0
        if self.ttft_per_stream_s:
            in_flight = sum(1 for s in self._streams.values() if s.priority <= priority)
        cache, hit, out_ids = self.cache, None, []
        salt = request.cache_salt
        adapter = request.adapter
        lora = blockhash.Lora(adapter.name, str(adapter.path)) if adapter is not None else None
        cached = None
        if cache is not None:
            hit = cache.lookup(ids, salt, lora)
            cached = hit.cached_blocks * cache.hasher.block_size
        blocks = self._received_blocks(request.kv_transfer_params, prompt_tokens)
        if self.kv_transfer is not None:
            cached = max(cached or 0, blocks * self.block_size)
        ttft = (
            self.ttft_s
            + self.ttft_per_stream_s * in_flight
            + (prompt_tokens - (cached or 0)) * self.prefill_s_per_token
            + blocks * self.transfer_s_per_block
        )
        self.prefills.append(
            Prefill(rid, prompt_tokens, cached or 0, ttft, blocks * self.block_size)
        )
        handover = self._handover(request, prompt_tokens)
        stream = _Stream(priority=priority, cache_salt=salt)
        self._streams[rid] = stream
        due = loop.time() + ttft * self._factor(rng)
        prefilled = False
        text = ""  # everything generated so far (stop strings need the whole tail)
        sent = 0  # characters of `text` already emitted
        produced = 0
        word_ids = self._word_ids
        try:
            if request.resume_ids:  # a continuation: replay them, go on after them
                produced = len(request.resume_ids)
                yield Delta(
                    "".join([words[(offset + i) % nwords] for i in range(produced)]),
                    produced,
                    prompt_tokens=prompt_tokens,
                    completion_tokens=produced,
                    cached_tokens=cached,
                    token_ids=list(request.resume_ids),
                )
            while True:
                delay = due - loop.time()
                if delay > 0:
                    # Same cost as asyncio.sleep (one call_later), but abort() can wake it.
                    stream.waiter = loop.create_future()
                    handle = loop.call_later(delay, _release, stream.waiter)
                    try:
                        await stream.waiter
                    finally:
                        handle.cancel()
                        stream.waiter = None
                if stream.aborted:
                    yield Delta(
                        text="",
                        num_tokens=0,
                        finished=True,
                        finish_reason="abort",
                        prompt_tokens=prompt_tokens,
                        completion_tokens=produced,
                        cached_tokens=cached,
                    )
                    return
                if not prefilled:
                    prefilled = True
                    if cache is not None and hit is not None:
                        cache.store(ids, hit.hashes, salt, lora)
                # Emit every token that is due by now (coalescing when we woke up late).
                now = loop.time()
                count = 0
                reason = None
                while True:
                    word = words[(offset + produced) % nwords]
                    if cache is not None:
                        out_ids.append(_word_id(word[1:]))
                    if self.stamp_tokens:
                        word = f"{word}@{due + wall_offset:.6f}"
                    text += word
                    produced += 1
                    count += 1
                    if stops:
                        window = text[max(0, len(text) - len(word) - holdback - 1) :]
                        hits = [i for i in (window.find(s) for s in stops) if i >= 0]
                        if hits:
                            cut = len(text) - len(window) + min(hits)
                            text = text[:cut]
                            reason = "stop"
                            break
                    if produced >= max_tokens:
                        reason = "length"
                        break
                    if eos_at is not None and produced >= eos_at:
                        reason = "stop"
                        break
                    due += self.itl_s * self._factor(rng)
                    if due > now:
                        break
                finished = reason is not None
                end = len(text) if finished else max(sent, len(text) - holdback)
                chunk = text[sent:end]
                sent = end
                if count == 1:  # the usual delta: no comprehension (about 1 us less)
                    delta_ids = [word_ids[(offset + produced - 1) % nwords]]
                else:
                    delta_ids = [
                        word_ids[(offset + p) % nwords] for p in range(produced - count, produced)
                    ]
                yield Delta(
                    text=chunk,
                    num_tokens=count,
                    finished=finished,
                    finish_reason=reason,
                    prompt_tokens=prompt_tokens,
                    completion_tokens=produced,
                    cached_tokens=cached,
                    token_ids=delta_ids,
                    kv_transfer_params=handover if finished else None,
                )
                if finished:
                    return
                if not stops:
                    text, sent = "", 0  # nothing to match against: keep memory flat
        finally:
            # Normal end, abort, or the consumer closed/cancelled the iterator.
            self._streams.pop(rid, None)
            if prefilled and out_ids and cache is not None and hit is not None:
                # The output's full blocks are computed too (as vLLM caches them).
                self._store_output(cache, ids, hit.hashes, out_ids, salt, lora)

    def _received_blocks(self, params: dict[str, Any] | None, prompt_tokens: int) -> int:
        """The prompt blocks a remote prefill's params bring (none on an engine without a
        connector, as vLLM ignores them there; at most the prompt's full blocks)."""
        if self.kv_transfer is None or not params or not params.get("do_remote_prefill"):
            return 0
        ids = params.get("remote_block_ids")
        if not isinstance(ids, list):
            return 0
        return min(len(ids), (prompt_tokens - 1) // self.block_size)

    def _handover(self, request: StreamRequest, prompt_tokens: int) -> dict[str, Any] | None:
        """The params a decode engine needs, for a request that asks for a remote decode."""
        params = request.kv_transfer_params
        if self.kv_transfer is None or not params or not params.get("do_remote_decode"):
            return None
        n = (prompt_tokens - 1) // self.block_size
        first, self._next_block = self._next_block, self._next_block + n
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": list(range(first, first + n)),
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_host": str(self.kv_transfer.get("kv_ip") or "127.0.0.1"),
            "remote_port": int(self.kv_transfer.get("kv_port") or 14579),
            "tp_size": 1,
        }

    @staticmethod
    def _store_output(
        cache: PrefixCache,
        ids: list[int],
        hashes: list[bytes],
        out_ids: list[int],
        salt: str | None,
        lora: blockhash.Lora | None,
    ) -> None:
        bs = cache.hasher.block_size
        seq = ids + out_ids
        if len(seq) // bs <= len(hashes):
            return
        start = len(hashes) * bs
        more = cache.hasher.block_hashes(
            seq[start:],
            cache_salt=salt,
            lora=lora,
            parent=hashes[-1] if hashes else None,
            start_block=len(hashes),
        )
        cache.store(seq, hashes + more, salt, lora)
