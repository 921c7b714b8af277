"""vLLM's KV-cache events: the wire format, and an asyncio subscriber per replica.

An engine started with prefix caching and `--kv-events-config '{"enable_kv_cache_events":
true, "publisher": "zmq", "endpoint": "tcp://*:PORT", "replay_endpoint": ...}'` publishes
on a ZMQ PUB socket one multipart message per engine step with cache changes (vLLM binds
the PUB socket only when the endpoint has `*` or `::`, and otherwise connects it to that
address; the replay socket always binds):

    [topic, sequence (8 bytes, big-endian, from 0 per publisher), msgpack KVEventBatch]

`KVEventBatch` is an array `[ts, events, data_parallel_rank]`; each event a map tagged
`"type"`: `BlockStored` (new full blocks: their hashes, the hash of the block before the
first, their token ids), `BlockRemoved` (evicted hashes) or `AllBlocksCleared`. A hash is
vLLM's `ExternalBlockHash`, an int (the default) or bytes (see `blockhash.external`). The
structs here mirror `vllm.distributed.kv_events` (vLLM 0.32) field for field, so they
decode vLLM's messages and encode messages vLLM's decoder reads (the simulator engine
publishes with them; vLLM's decoder needs the fields it declares without a default). Fields
a later vLLM adds are ignored when decoding.

Replay (vLLM's ROUTER socket at `replay_endpoint`): a DEALER sends `[b"", start sequence
(8 bytes, big-endian)]` and receives `[b"", topic, sequence, payload]` for every buffered
batch from that sequence on (the publisher keeps the last `buffer_steps`), then
`[b"", b"", END_SEQ, b""]`.

A PUB socket drops messages for a subscriber that falls behind (past its high-water mark)
and a subscriber connecting late misses what came before: `Subscriber` notices a gap in
the sequence, catches up through the replay endpoint when the pod has one, and otherwise
(or when the replay no longer holds the missing batches, or the publisher restarted)
hands its consumer a `Reset`: that pod's index must be cleared and rebuilt from what
follows. The port carries prompt token ids in clear and takes no credentials: only the
router may reach it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

log = logging.getLogger("sluice.kvcache.kvevents")

ExternalBlockHash = bytes | int
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM_GPU = "GPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """One cache change; encoded as a map with `"type": <class name>`."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    # Required (no default), as in vLLM: its decoder refuses a BlockStored without them.
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    # Per block, untagged: the LoRA name, (mm identifier, offset) pairs, the cache salt.
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[KVEvent]


class KVEventsError(ValueError):
    """A message that is not a KV-event batch in vLLM's format."""


_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_encoder = msgspec.msgpack.Encoder()


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def decode_message(frames: Sequence[bytes]) -> tuple[int, KVEventBatch]:
    """`[topic, sequence, payload]` -> (sequence, batch)."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise KVEventsError(f"expected [topic, 8-byte sequence, payload], got {len(frames)} frames")
    try:
        batch = _decoder.decode(frames[2])
    except msgspec.DecodeError as e:
        raise KVEventsError(f"undecodable KV-event batch: {e}") from None
    return int.from_bytes(frames[1], "big"), batch


@dataclass(frozen=True, slots=True)
class Batch:
    """A batch of events from `pod`, in sequence order."""

    pod: str
    seq: int
    batch: KVEventBatch


@dataclass(frozen=True, slots=True)
class Reset:
    """`pod`'s events were lost (or its publisher restarted): clear its index."""

    pod: str
    reason: str


Update = Batch | Reset


class Subscriber:
    """Follows one pod's KV events: `async for update in subscriber.updates()`.

    `run()` (a task the owner starts and cancels) connects a SUB socket to `endpoint`,
    decodes each message, checks the sequence and queues the batches in order. A gap is
    filled from `replay_endpoint` when the pod has one (a replay that times out, or no
    longer holds the missing batches, becomes a `Reset`); the first message catches up
    from sequence 0 the same way, so a router that starts late learns the cache the pod
    already has (as far as the publisher's buffer reaches). A sequence that goes back means
    the publisher restarted: `Reset`. The queue is bounded: a consumer that falls
    `queue_size` updates behind loses them and gets a `Reset` first.
    """

    def __init__(
        self,
        pod: str,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        queue_size: int = 1024,
        replay_timeout: float = 2.0,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.pod, self.endpoint, self.replay_endpoint = pod, endpoint, replay_endpoint
        self.topic = topic.encode()
        self.replay_timeout = replay_timeout
        self.last_seq: int | None = None
        self.resets = 0  # Resets queued so far (lost events)
        self._ctx = context or zmq.asyncio.Context.instance()
        if queue_size < 2:
            raise ValueError("queue_size must leave room for a Reset and an update")
        self._queue: asyncio.Queue[Update] = asyncio.Queue(maxsize=queue_size)

    async def updates(self) -> AsyncIterator[Update]:
        while True:
            yield await self._queue.get()

    def get_nowait(self) -> Update | None:
        try:
            return self._queue.get_nowait()
        except asyncio.QueueEmpty:
            return None

    async def run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        try:
            while True:
                frames = await sub.recv_multipart()
                try:
                    seq, batch = decode_message(frames)
                except KVEventsError as e:
                    log.warning("kv events from %s: %s", self.pod, e)
                    continue
                await self._accept(seq, batch)
        finally:
            sub.close(linger=0)

    async def _accept(self, seq: int, batch: KVEventBatch) -> None:
        # A SUB socket never repeats a message and replays only fill what came before it,
        # so a sequence at or below the last one is a new publisher (the engine restarted).
        if self.last_seq is not None and seq <= self.last_seq:
            self._reset("publisher restarted")
        last = self.last_seq
        start = 0 if last is None else last + 1
        if seq != start and not await self._replay(start, seq) and last is not None:
            self._reset(f"lost batches {start}..{seq - 1}")
        self._put(Batch(self.pod, seq, batch))
        self.last_seq = seq

    async def _replay(self, start: int, upto: int) -> bool:
        """Queue the batches [start, upto) from the replay endpoint; True if it had them
        all. A late start (no batch seen yet) takes whatever the buffer still has."""
        if self.replay_endpoint is None:
            return False
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        got: list[tuple[int, KVEventBatch]] = []
        try:
            await dealer.send_multipart([b"", seq_bytes(start)])
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), self.replay_timeout)
                if len(frames) == 4 and frames[2] == END_SEQ:
                    break
                got.append(decode_message(frames[1:]))
        except (TimeoutError, KVEventsError) as e:
            log.warning("kv events replay from %s failed: %s", self.pod, e)
            return False
        finally:
            dealer.close(linger=0)
        have = dict(got)
        missing = [s for s in range(start, upto) if s not in have]
        if missing and self.last_seq is not None:
            return False
        # Complete, or a late start: the unbroken run of batches just before `upto`.
        first = max(missing, default=start - 1) + 1
        for s in range(first, upto):
            self._put(Batch(self.pod, s, have[s]))
            self.last_seq = s
        return not missing

    def _reset(self, reason: str) -> None:
        log.info("kv events from %s: %s; its index starts over", self.pod, reason)
        self.resets += 1
        self.last_seq = None
        self._put(Reset(self.pod, reason))

    def _put(self, update: Update) -> None:
        if self._queue.full():
            # The consumer fell behind: drop what is queued; it clears the index and rebuilds.
            with contextlib.suppress(asyncio.QueueEmpty):
                while True:
                    self._queue.get_nowait()
            self.resets += 1
            self._queue.put_nowait(Reset(self.pod, "consumer fell behind"))
        self._queue.put_nowait(update)
