"""Which blocks each worker holds, learned from the workers' own KV events.

A worker names its blocks with its own hashes, which the router cannot recompute (vLLM
seeds them per process). The index renames them by the router's chain hash
(``common.kv_hash``) over the event's tokens, chained through the parent the event names::

    event:  parent=w7  hashes=[w8, w9]  tokens=[a0..a15, b0..b15]
    index:  ours(w8) = H(ours(w7), a0..a15)    ours(w9) = H(ours(w8), b0..b15)

so a prompt's blocks, hashed the same way from ``ROOT``, find every worker that holds them.
A stored run whose parent the index does not know (events it missed) is left out: workers
reuse only a prefix walked from the first block, which could not reach it anyway.

What else a worker hashed into a block is hashed into ours, from the event: a salt (the
chain's root), a LoRA adapter's name (every block of its chain: a root of its own, so a
base-model prompt never matches an adapter's blocks), and a multimodal item or prompt
embeddings (that block only). The router cannot name an image as vLLM does, so blocks
holding one are never matched: a prompt with images matches up to its first image.

Each message's sequence number must be the last one plus one. A gap (lost messages) or a
restart (numbers from 0 again), or a dropped connection, leaves the index unsure of what
that worker holds. A worker with a replay endpoint is asked for the missed batches (from 0
for a restart, or for the first message a late subscriber sees); what a replay cannot give
back, and every gap of a worker without one, makes the index forget that worker and
relearn it from the next events on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from splitserve.common.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    ExternalBlockHash,
    decode_message,
    fetch_replay,
    first_block_salt,
    parse_source,
    subscribe,
)
from splitserve.common.kv_hash import BlockHash, block_hash, hash_blocks, root_hash

log = logging.getLogger(__name__)

# The router's names for token prefixes never leave the router, so one root serves every
# worker and model: equal tokens mean equal blocks wherever they came from. A salted chain
# (a tenant's, a cache_salt's) has a root of its own: equal tokens of two tenants are two
# blocks, as they are in the workers.
_ROOT_NAME = "splitserve-router-kv-index"
ROOT = root_hash(_ROOT_NAME)


def chain_root(salt: str = "", lora: str | None = None) -> BlockHash:
    """The index's root for chains hashed with ``salt``, of LoRA adapter ``lora`` (None:
    the base model)."""
    if lora is not None:
        return root_hash(f"{_ROOT_NAME}/lora/{lora}", salt)
    return root_hash(_ROOT_NAME, salt) if salt else ROOT


_pack = msgspec.msgpack.Encoder().encode


def _content_keys(event: BlockStored, i: int) -> bytes:
    """Block ``i``'s multimodal and prompt-embeds keys, as bytes to hash into it: the
    non-string ``extra_keys`` (strings are the LoRA name and the salt)."""
    keys = event.extra_keys[i] if event.extra_keys and i < len(event.extra_keys) else None
    if not keys:
        return b""
    content = [k for k in keys if not isinstance(k, str)]
    return _pack(content) if content else b""


@dataclass(slots=True)
class IndexStats:
    batches: int = 0
    gaps: int = 0  # sequence gaps and restarts that forgot a worker's blocks
    replayed: int = 0  # batches learned from replays
    orphans: int = 0  # stored runs with an unknown parent (or shape), left out
    malformed: int = 0  # messages that were no event batch


class WorkerBlocks:
    """One worker's blocks, by the router's hash.

    ``_ours[w] = [h, n]``: the worker's hash ``w`` is our ``h``, stored ``n`` times over
    (vLLM may hold one hash in several blocks, and removes each); ``held[h]`` counts the
    worker hashes that are ``h``.
    """

    __slots__ = ("held", "_ours", "block_size", "next_seq")

    def __init__(self) -> None:
        self.held: dict[BlockHash, int] = {}
        self._ours: dict[ExternalBlockHash, list] = {}
        self.block_size: int | None = None  # from the first stored event
        self.next_seq: int | None = None

    def __len__(self) -> int:
        return len(self.held)

    def clear(self) -> None:
        self.held.clear()
        self._ours.clear()

    def stored(self, event: BlockStored) -> bool:
        """Index a stored run; False when its parent (or shape) is unknown."""
        bs, hashes, tokens = event.block_size, event.block_hashes, event.token_ids
        salt, extra, lora = first_block_salt(event), b"", event.lora_name
        if event.parent_block_hash is None:
            parent = chain_root(salt, lora)
        else:
            known = self._ours.get(event.parent_block_hash)
            if known is None:
                return False
            parent = known[0]
            if salt:  # a split chain's switch block (``common.kv_hash.split_salt``)
                extra = chain_root(salt, lora)
        if bs < 1 or len(tokens) != len(hashes) * bs or self.block_size not in (None, bs):
            return False  # skipped blocks (sliding windows) or a second block size
        self.block_size = bs
        for i, theirs in enumerate(hashes):
            mixed = (extra if i == 0 else b"") + _content_keys(event, i)
            parent = block_hash(parent, tokens[i * bs : (i + 1) * bs], mixed)
            self._store(theirs, parent)
        return True

    def _store(self, theirs: ExternalBlockHash, ours: BlockHash) -> None:
        entry = self._ours.get(theirs)
        if entry is not None:
            entry[1] += 1
            return
        self._ours[theirs] = [ours, 1]
        self.held[ours] = self.held.get(ours, 0) + 1

    def removed(self, event: BlockRemoved) -> None:
        for theirs in event.block_hashes:
            entry = self._ours.get(theirs)
            if entry is None:
                continue
            entry[1] -= 1
            if entry[1] == 0:
                del self._ours[theirs]
                ours = entry[0]
                if self.held[ours] == 1:
                    del self.held[ours]
                else:
                    self.held[ours] -= 1

    def prefix(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of ``hashes`` this worker holds."""
        held = self.held
        for i, h in enumerate(hashes):
            if h not in held:
                return i
        return len(hashes)


class KVIndex:
    """Per worker URL, the blocks it holds; fed by ``KVEventSubscriber`` (or ``apply``)."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerBlocks] = {}
        self.stats = IndexStats()
        self.loras: set[str] = set()  # LoRA adapters any worker has stored blocks of

    def apply(self, url: str, seq: int, batch: EventBatch) -> None:
        """One message from ``url``'s publisher, numbered ``seq``."""
        blocks = self.workers.get(url)
        if blocks is None:
            blocks = self.workers[url] = WorkerBlocks()
        if blocks.next_seq is not None and seq != blocks.next_seq:
            log.info(
                "KV events of %s: expected #%d, got #%d; relearning", url, blocks.next_seq, seq
            )
            self.stats.gaps += 1
            blocks.clear()
        blocks.next_seq = seq + 1
        self.stats.batches += 1
        for event in batch.events:
            if isinstance(event, BlockStored):
                if event.lora_name is not None:
                    self.loras.add(event.lora_name)
                if not blocks.stored(event):
                    self.stats.orphans += 1
            elif isinstance(event, BlockRemoved):
                blocks.removed(event)
            elif isinstance(event, AllBlocksCleared):
                blocks.clear()

    def forget(self, url: str) -> None:
        """Drop what ``url`` holds and its sequence (it disconnected or restarted)."""
        self.workers.pop(url, None)

    def expected(self, url: str) -> int | None:
        """The number of ``url``'s next message; None before the first."""
        blocks = self.workers.get(url)
        return None if blocks is None else blocks.next_seq

    def restart(self, url: str) -> None:
        """Forget ``url``'s blocks and numbering, as a gap does: the next message starts
        afresh."""
        if url in self.workers:
            self.stats.gaps += 1
            self.forget(url)

    def prompt_hashes(
        self, token_ids: Sequence[int], block_size: int, salt: str = "", lora: str | None = None
    ) -> list[BlockHash]:
        """The router's hashes of the blocks a worker could reuse for this prompt: the full
        blocks but one holding the last token (a worker always computes that one)."""
        usable = (len(token_ids) - 1) // block_size
        return hash_blocks(token_ids[: usable * block_size], chain_root(salt, lora), block_size)

    def matches(
        self,
        urls: Sequence[str],
        token_ids: Sequence[int],
        salt: str = "",
        model: str | None = None,
    ) -> dict[str, int]:
        """Per URL, how many of the prompt's leading tokens, hashed with ``salt`` (the
        request's KV salt), that worker holds (whole blocks: what it would report as
        ``cached_tokens``); 0 for workers it knows nothing of. ``model``: the request's;
        once a worker has stored blocks of a LoRA adapter by that name, the prompt is that
        adapter's."""
        lora = model if model in self.loras else None
        out: dict[str, int] = {}
        hashes: dict[int, list[BlockHash]] = {}  # per block size, usually just one
        for url in urls:
            blocks = self.workers.get(url)
            if blocks is None or not blocks.held or blocks.block_size is None:
                out[url] = 0
                continue
            bs = blocks.block_size
            if bs not in hashes:
                hashes[bs] = self.prompt_hashes(token_ids, bs, salt, lora)
            out[url] = blocks.prefix(hashes[bs]) * bs
        return out


class KVEventSubscriber:
    """Subscribes to each worker's KV events endpoint and feeds the index, on the running
    event loop. ``endpoints``: worker URL -> ``tcp://HOST:PORT``."""

    def __init__(
        self,
        index: KVIndex,
        endpoints: Mapping[str, str],
        topic: str = "",
        replay_timeout: float = 2.0,
    ) -> None:
        self.index = index
        self.endpoints = dict(endpoints)  # URL -> ENDPOINT[,REPLAY] (``parse_source``)
        self.topic = topic
        self.replay_timeout = replay_timeout
        self._context = zmq.asyncio.Context()
        self._tasks: dict[str, list[asyncio.Task]] = {}
        self.connected: set[str] = set()  # URLs whose publisher is connected now

    def start(self) -> None:
        for url, endpoint in self.endpoints.items():
            self._subscribe(url, endpoint)

    async def add(self, url: str, endpoint: str) -> None:
        """Subscribe to a worker that joined at run time (``POST /workers``); a worker
        already subscribed is subscribed again at ``endpoint``."""
        await self.remove(url)
        self.endpoints[url] = endpoint
        self._subscribe(url, endpoint)

    async def remove(self, url: str) -> None:
        """Stop listening to ``url`` and forget what it held."""
        self.endpoints.pop(url, None)
        await _cancel(self._tasks.pop(url, []))
        self.connected.discard(url)
        self.index.forget(url)

    def _subscribe(self, url: str, spec: str) -> None:
        endpoint, replay = parse_source(spec)
        socket = subscribe(self._context, endpoint, self.topic, connect=False)
        # The monitor before the connect: a handshake done first would never be reported.
        monitor = socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        socket.connect(endpoint)
        self._tasks[url] = [
            asyncio.create_task(self._receive(url, socket, replay)),
            asyncio.create_task(self._watch(url, monitor)),
        ]

    async def stop(self) -> None:
        await _cancel([t for tasks in self._tasks.values() for t in tasks])
        self._tasks.clear()
        self._context.destroy(linger=0)

    async def _receive(self, url: str, socket: zmq.asyncio.Socket, replay: str | None) -> None:
        try:
            while True:
                frames = await socket.recv_multipart()
                try:
                    seq, batch = decode_message(frames)
                except ValueError as e:
                    self.index.stats.malformed += 1
                    log.warning("KV events of %s: a malformed message (%s)", url, e)
                    continue
                try:
                    if replay is not None:
                        await self._catch_up(url, replay, seq)
                    self.index.apply(url, seq, batch)
                except Exception:  # a bug must not stop the learning: relearn this worker
                    log.exception("KV events of %s: a batch failed to apply", url)
                    self.index.forget(url)
        finally:
            socket.close(linger=0)

    async def _catch_up(self, url: str, replay: str, seq: int) -> None:
        """Before message ``seq``: apply the batches missed since the last one (all from 0
        when it is the first, or when the worker restarted), as far as the replay has them.
        A gap the replay leaves open forgets the worker, as without a replay."""
        expected = self.index.expected(url)
        if expected == seq or (expected is None and seq == 0):
            return
        if expected is not None and seq < expected:  # numbered afresh: a restart
            self.index.restart(url)
            expected = None
        start = 0 if expected is None else expected
        got = await fetch_replay(self._context, replay, start, self.replay_timeout)
        missed = [(n, b) for n, b in got or () if n < seq]
        if expected is not None and (not missed or missed[0][0] != start):
            self.index.restart(url)  # the gap reaches past what the worker keeps
        for n, batch in missed:
            self.index.apply(url, n, batch)
        self.index.stats.replayed += len(missed)

    async def _watch(self, url: str, monitor: zmq.asyncio.Socket) -> None:
        """A lost connection may hide a restart whose first events are lost as well: the
        worker's blocks are forgotten at once rather than trusted until the numbers jump."""
        try:
            while True:
                event = await recv_monitor_message(monitor)
                if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self.connected.add(url)
                elif event["event"] == zmq.EVENT_DISCONNECTED:
                    self.connected.discard(url)
                    self.index.forget(url)
        finally:
            monitor.close(linger=0)


async def _cancel(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
