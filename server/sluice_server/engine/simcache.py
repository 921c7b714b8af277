"""The simulator's prefix cache and its KV events, in vLLM's format.

`PrefixCache` is one replica's KV cache as a prefix cache sees it: an LRU of full blocks
keyed by vLLM's block-hash chain (`kvcache.blockhash`, so the router matches the
simulator's events with the code that matches vLLM's), a capacity in blocks, and the rule
that the last prompt token is always computed. It does not model blocks pinned by running
requests (vLLM cannot evict those; here any block can go).

`EventPublisher` publishes the cache's changes as vLLM's `ZmqEventPublisher` does: a PUB
socket sending `[topic, sequence, msgpack KVEventBatch]`, bound when the endpoint has `*`
or `::` (vLLM's rule; otherwise it connects), and a ROUTER socket at the replay endpoint
answering `[b"", start sequence]` with the buffered batches from there and an end marker.
The events carry prompt token ids in clear and the sockets take no credentials.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from ..kvcache import blockhash, kvevents

log = logging.getLogger("sluice.engine.simulator")


@dataclass(frozen=True, slots=True)
class KvEventsConfig:
    """The fields of vLLM's `--kv-events-config` JSON the simulator honours (the others,
    e.g. `max_queue_size`, are accepted and ignored)."""

    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    topic: str = ""

    @classmethod
    def from_json(cls, text: str) -> KvEventsConfig | None:
        """None when events are off (`enable_kv_cache_events` false, or publisher `null`)."""
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("the KV events config must be a JSON object")
        if not raw.get("enable_kv_cache_events") or raw.get("publisher", "zmq") == "null":
            return None
        if raw.get("publisher", "zmq") != "zmq":
            raise ValueError(f"unknown KV events publisher {raw['publisher']!r} (zmq or null)")
        fields = {
            k: raw[k]
            for k in ("endpoint", "replay_endpoint", "buffer_steps", "hwm", "topic")
            if k in raw
        }
        return cls(**fields)


class EventPublisher:
    """vLLM's ZMQ KV-event publisher, on the event loop (sends never block: a PUB socket
    drops for a subscriber past its high-water mark)."""

    def __init__(self, config: KvEventsConfig) -> None:
        self.config = config
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        if "*" in config.endpoint or "::" in config.endpoint:
            self._pub.bind(config.endpoint)
        else:
            self._pub.connect(config.endpoint)
        self._topic = config.topic.encode()
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._replay: zmq.asyncio.Socket | None = None
        if config.replay_endpoint is not None:
            self._replay = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
            self._replay.bind(config.replay_endpoint)
        self._replay_task: asyncio.Task[None] | None = None

    def publish(self, events: list[kvevents.KVEvent]) -> None:
        if not events:
            return
        if self._replay is not None and self._replay_task is None:
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())
        batch = kvevents.KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0)
        payload = kvevents.encode_batch(batch)
        seq, self._seq = self._seq, self._seq + 1
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart([self._topic, kvevents.seq_bytes(seq), payload], zmq.NOBLOCK)
        self._buffer.append((seq, payload))

    async def _serve_replay(self) -> None:
        sock = self._replay
        assert sock is not None
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3:
                log.warning("invalid KV events replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await sock.send_multipart(
                        [client, b"", self._topic, kvevents.seq_bytes(seq), payload]
                    )
            await sock.send_multipart([client, b"", b"", kvevents.END_SEQ, b""])

    def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)


@dataclass(frozen=True, slots=True)
class CacheHit:
    """A prompt's lookup: its block hashes and how many leading blocks were cached."""

    hashes: list[bytes]
    cached_blocks: int


class PrefixCache:
    """One replica's prefix cache: an LRU of `capacity` full blocks."""

    def __init__(
        self,
        capacity: int,
        hasher: blockhash.BlockHasher,
        publisher: EventPublisher | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError("the prefix cache needs a capacity of at least one block")
        self.capacity, self.hasher, self.publisher = capacity, hasher, publisher
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def lookup(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        lora: blockhash.Lora | None = None,
    ) -> CacheHit:
        """The prompt's leading cached blocks (touched: most recently used now)."""
        hashes = self.hasher.block_hashes(token_ids, cache_salt=cache_salt, lora=lora)
        usable = blockhash.cacheable_blocks(len(token_ids), self.hasher.block_size)
        hit = 0
        for h in hashes[:usable]:
            if h not in self._blocks:
                break
            self._blocks.move_to_end(h)
            hit += 1
        return CacheHit(hashes, hit)

    def store(
        self,
        token_ids: Sequence[int],
        hashes: Sequence[bytes],
        cache_salt: str | None = None,
        lora: blockhash.Lora | None = None,
    ) -> None:
        """Cache the full blocks `hashes` of `token_ids` (computed: a prefill or a finished
        decode), evicting the least recently used past the capacity; publish the changes
        (one `BlockStored` per run of new blocks, one `BlockRemoved` per evicted block, as
        vLLM sends them)."""
        bs = self.hasher.block_size
        events: list[kvevents.KVEvent] = []
        run: list[int] = []

        def flush() -> None:
            if run and self.publisher is not None:
                events.append(self._stored(token_ids, hashes, run, cache_salt, lora))
            run.clear()

        for i, h in enumerate(hashes[: len(token_ids) // bs]):
            if h in self._blocks:
                self._blocks.move_to_end(h)
                flush()
                continue
            self._blocks[h] = None
            run.append(i)
            while len(self._blocks) > self.capacity:
                evicted, _ = self._blocks.popitem(last=False)
                if self.publisher is not None:
                    flush()
                    events.append(
                        kvevents.BlockRemoved(
                            block_hashes=[blockhash.external(evicted)],
                            medium=kvevents.MEDIUM_GPU,
                            group_idx=0,
                        )
                    )
        flush()
        if self.publisher is not None:
            self.publisher.publish(events)

    def _stored(
        self,
        token_ids: Sequence[int],
        hashes: Sequence[bytes],
        run: list[int],
        cache_salt: str | None,
        lora: blockhash.Lora | None,
    ) -> kvevents.BlockStored:
        bs = self.hasher.block_size
        first = run[0]
        extra: list[tuple[Any, ...] | None] = []
        for i in run:  # vLLM's untagged per-block keys: LoRA name, then the salt on block 0
            keys = ([lora.name] if lora else []) + ([cache_salt] if cache_salt and i == 0 else [])
            extra.append(tuple(keys) or None)
        return kvevents.BlockStored(
            block_hashes=[blockhash.external(hashes[i]) for i in run],
            parent_block_hash=blockhash.external(hashes[first - 1]) if first else None,
            token_ids=list(token_ids[first * bs : (run[-1] + 1) * bs]),
            block_size=bs,
            lora_id=None,
            medium=kvevents.MEDIUM_GPU,
            lora_name=lora.name if lora else None,
            extra_keys=extra if any(k is not None for k in extra) else None,
            group_idx=0,
        )

    def clear(self) -> None:
        self._blocks.clear()
        if self.publisher is not None:
            self.publisher.publish([kvevents.AllBlocksCleared()])
