"""KV cache events in vLLM's wire format: which blocks a worker's prefix cache holds.

A worker publishes on a ZMQ PUB socket; each message has three frames::

    [topic (utf-8, may be empty), seq (8 bytes, big-endian, 0, 1, 2, ...), payload (msgpack)]

The payload is an ``EventBatch``, a msgpack *array* ``[ts, events, data_parallel_rank]``;
each event is a msgpack *map* tagged by its class name under ``"type"``, fields with their
default value left out. These are vLLM 0.32's ``vllm.distributed.kv_events`` structs, field
for field, so a subscriber reads vLLM and the builtin engine alike (tests/common checks bytes
against vLLM's own classes). vLLM starts publishing with ``--kv-events-config
'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:PORT"}'``
(``vllm_kv_events_config``).

A ``BlockStored`` names consecutive full blocks: ``block_hashes[i]`` covers
``token_ids[i * block_size : (i + 1) * block_size]`` and chains to the previous one, the
first to ``parent_block_hash`` (None: the first block of a prompt). Hashes are the worker's
own (vLLM's are 64-bit ints seeded per process; the builtin engine's are its chain hashes),
so a subscriber can only relate them through the tokens (``router/kv_index.py``).

The block manager reports its cache changes to a ``BlockEventSink``, which hands events to
an ``EventPublisher``: its thread batches whatever has queued up, encodes and sends, so an
engine step never waits on the socket.

A PUB socket drops what a slow or late subscriber missed. With a replay endpoint (vLLM's
``replay_endpoint``, a ROUTER socket) the publisher keeps its last ``REPLAY_BUFFER`` batches
and resends them from a sequence number on request::

    request:  [b"", seq (8 bytes)]                           from a DEALER (or REQ) socket
    replies:  [b"", topic, seq_i, payload_i] for every kept seq_i >= seq,
              then [b"", b"", END_SEQ, b""]

``fetch_replay`` is the subscriber's side.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

log = logging.getLogger(__name__)

ExternalBlockHash = bytes | int  # vLLM: int by default, bytes with VLLM_KV_EVENTS_USE_INT_...=0
MEDIUM_GPU = "GPU"  # the engine's device pool (vLLM names its own so on CPU machines too)
SEQ_BYTES = 8
END_SEQ = (-1).to_bytes(SEQ_BYTES, "big", signed=True)  # a replay's last message
REPLAY_BUFFER = 10_000  # batches a publisher keeps for replay (vLLM's buffer_steps)


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """An event; encoded as a map with ``"type": <class name>``."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None  # per block: lora, mm, cache salt
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


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One message's payload: what one engine step (or burst) changed."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    """A batch whose events are decoded one by one: an event type this version does not
    know (vLLM adds some) costs only itself, not the whole batch."""

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(_RawBatch)
_event_decoder = msgspec.msgpack.Decoder(KVEvent)


def encode_batch(batch: EventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> EventBatch:
    """The batch in ``payload``, without the events of types it does not know.

    Raises ``msgspec.DecodeError`` (a ``ValueError``) when the payload is no batch at all.
    """
    raw = _batch_decoder.decode(payload)
    events: list[KVEvent] = []
    for item in raw.events:
        try:
            events.append(_event_decoder.decode(item))
        except msgspec.ValidationError as e:
            log.debug("skipping a KV event this version does not read: %s", e)
    return EventBatch(raw.ts, events, raw.data_parallel_rank)


def decode_message(frames: Sequence[bytes]) -> tuple[int, EventBatch]:
    """``(seq, batch)`` of one ``[topic, seq, payload]`` message; ``ValueError`` if malformed."""
    if len(frames) != 3 or len(frames[1]) != SEQ_BYTES:
        raise ValueError(f"a KV event message has 3 frames and an 8-byte seq, got {frames!r:.80}")
    return int.from_bytes(frames[1], "big"), decode_batch(frames[2])


class EventPublisher:
    """Publishes KV events on a ZMQ PUB socket, framed and numbered as vLLM does.

    ``emit`` never blocks: events queue up and a thread sends each burst as one batch (a
    PUB socket drops, never blocks, past its high-water mark). Unlike vLLM, which connects
    to an endpoint that names a host, the publisher always binds: ``tcp://127.0.0.1:PORT``
    serves loopback, ``tcp://*:PORT`` every interface, port 0 any free port (``endpoint``
    then says which).
    """

    _STOP = object()

    def __init__(
        self,
        endpoint: str,
        topic: str = "",
        hwm: int = 100_000,
        data_parallel_rank: int = 0,
        replay_endpoint: str | None = None,
        replay_buffer: int = REPLAY_BUFFER,
    ) -> None:
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._socket = _bound(zmq.PUB, endpoint, hwm)
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint: str | None = None
        self._kept: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=replay_buffer)
        self._kept_lock = threading.Lock()
        self._stopping = threading.Event()
        self._replay_thread: threading.Thread | None = None
        if replay_endpoint is not None:
            try:
                replay = _bound(zmq.ROUTER, replay_endpoint, hwm)
            except ValueError:
                self._socket.close(linger=0)
                raise
            self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
            self._replay_thread = threading.Thread(
                target=self._serve_replays, args=(replay,), name="kv-events-replay", daemon=True
            )
            self._replay_thread.start()
        self.batches_sent = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def emit(self, event: KVEvent) -> None:
        """Queue one event (any thread)."""
        self._queue.put(event)

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued, then stop; the socket is closed even if the thread hangs."""
        self._queue.put(self._STOP)
        self._thread.join(timeout)
        self._socket.close(linger=0)
        self._stopping.set()
        if self._replay_thread is not None:
            self._replay_thread.join(timeout)

    def _run(self) -> None:
        while True:
            events, stop = self._take()
            if events:
                self._send(EventBatch(time.time(), events, self._rank))
            if stop:
                return

    def _take(self) -> tuple[list[KVEvent], bool]:
        """Everything queued, waiting for the first item; and whether to stop after it."""
        events: list[KVEvent] = []
        item = self._queue.get()
        while item is not self._STOP:
            events.append(item)
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return events, False
        return events, True

    def _send(self, batch: EventBatch) -> None:
        number = self.batches_sent
        seq = number.to_bytes(SEQ_BYTES, "big")
        payload = encode_batch(batch)
        if self._replay_thread is not None:
            with self._kept_lock:
                self._kept.append((number, payload))
        # Counted before it can arrive anywhere, and numbered even if lost: a subscriber
        # must see the gap rather than a quiet loss.
        self.batches_sent += 1
        try:
            self._socket.send_multipart((self._topic, seq, payload))
        except zmq.ZMQError:
            log.exception("could not publish KV events")

    def _serve_replays(self, socket: zmq.Socket) -> None:
        """Answer replay requests until ``close``; the ROUTER socket is this thread's own."""
        try:
            while not self._stopping.is_set():
                if not socket.poll(100):
                    continue
                frames = socket.recv_multipart()
                if len(frames) != 3 or len(frames[2]) != SEQ_BYTES:
                    log.warning("KV events: a malformed replay request (%d frames)", len(frames))
                    continue
                client, start = frames[0], int.from_bytes(frames[2], "big")
                with self._kept_lock:
                    kept = [(n, p) for n, p in self._kept if n >= start]
                for n, payload in kept:
                    seq = n.to_bytes(SEQ_BYTES, "big")
                    socket.send_multipart((client, b"", self._topic, seq, payload))
                socket.send_multipart((client, b"", b"", END_SEQ, b""))
        except zmq.ZMQError:
            log.exception("KV events: the replay endpoint failed")
        finally:
            socket.close(linger=0)


def _bound(kind: int, endpoint: str, hwm: int) -> zmq.Socket:
    socket = zmq.Context.instance().socket(kind)
    socket.set_hwm(hwm)
    try:
        socket.bind(endpoint)
    except zmq.ZMQError as e:
        socket.close(linger=0)
        raise ValueError(f"cannot publish KV events on {endpoint}: {e}") from e
    return socket


async def fetch_replay(
    context: zmq.asyncio.Context, endpoint: str, start: int, timeout: float = 2.0
) -> list[tuple[int, EventBatch]] | None:
    """The batches numbered ``start`` on that the publisher's replay ``endpoint`` still
    keeps, in order (possibly starting later than ``start``: it keeps only its last ones);
    None when it does not answer within ``timeout`` seconds or answers garbage."""
    socket = context.socket(zmq.DEALER)
    socket.connect(endpoint)
    out: list[tuple[int, EventBatch]] = []
    try:
        await socket.send_multipart((b"", start.to_bytes(SEQ_BYTES, "big")))
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not await socket.poll(int(left * 1000) + 1):
                break
            frames = await socket.recv_multipart()
            if len(frames) == 4 and frames[2] == END_SEQ:
                return out
            try:
                out.append(decode_message(frames[1:]))
            except ValueError as e:
                log.warning("KV events: a malformed replay from %s (%s)", endpoint, e)
                return None
        log.info("KV events: no replay from %s within %.1f s", endpoint, timeout)
        return None
    finally:
        socket.close(linger=0)


def subscribe(
    context: zmq.Context, endpoint: str, topic: str = "", connect: bool = True
) -> zmq.Socket:
    """A SUB socket connected to a publisher's ``endpoint`` (``tcp://HOST:PORT``) for
    ``topic`` (a prefix; "" is everything); a ``zmq.asyncio.Context`` makes an async one.
    ZMQ reconnects by itself, so the publisher may start later or restart. ``connect=False``
    leaves the connect to the caller (a monitor attached after it can miss the handshake)."""
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
    if connect:
        socket.connect(endpoint)
    return socket


class BlockEventSink:
    """What the block manager tells about its prefix cache, as KV events on a publisher
    (``BlockManager.events``). Called under the engine's lock, on whichever thread holds it."""

    def __init__(self, publisher: EventPublisher, block_size: int, medium: str = MEDIUM_GPU):
        self.publisher = publisher
        self.block_size = block_size
        self.medium = medium

    def stored(
        self,
        hashes: list[bytes],
        parent: bytes | None,
        blocks: Sequence[tuple[int, ...]],
        salt: str = "",
    ) -> None:
        """A stored run; its first block carries ``salt`` in ``extra_keys`` (a salted
        chain's first block, where vLLM puts a request's ``cache_salt``, or a split chain's
        switch block)."""
        tokens = [t for block in blocks for t in block]
        extra = salted_extra_keys(len(hashes), salt)
        self.publisher.emit(
            BlockStored(
                list(hashes), parent, tokens, self.block_size, None, self.medium, None, extra
            )
        )

    def removed(self, block_hash: bytes) -> None:
        self.publisher.emit(BlockRemoved([block_hash], self.medium))

    def cleared(self) -> None:
        self.publisher.emit(AllBlocksCleared())


def salted_extra_keys(num_blocks: int, salt: str) -> list[tuple[Any, ...] | None] | None:
    """``extra_keys`` of a run of ``num_blocks`` blocks whose first is hashed with ``salt``:
    the salt in the first block's entry, as vLLM's; None for the empty salt."""
    if not salt or num_blocks < 1:
        return None
    return [(salt,), *([None] * (num_blocks - 1))]


def first_block_salt(event: BlockStored) -> str:
    """The salt a stored run's first block was hashed with ("" when none): the string
    among its ``extra_keys`` (a LoRA name comes first when ``lora_name`` is set; multimodal
    entries are tuples)."""
    if not event.extra_keys or event.extra_keys[0] is None:
        return ""
    keys = list(event.extra_keys[0])
    if event.lora_name is not None and keys and keys[0] == event.lora_name:
        keys = keys[1:]
    return next((k for k in keys if isinstance(k, str)), "")


def vllm_kv_events_config(port: int, topic: str = "", replay_port: int | None = None) -> str:
    """The ``--kv-events-config`` that makes a vLLM server publish on ``port`` (and answer
    replays on ``replay_port``). vLLM binds only a wildcard endpoint (one naming a host, it
    connects to), so this one listens on every interface; subscribers connect to
    ``tcp://HOST:port``."""
    config: dict[str, Any] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "topic": topic,
    }
    if replay_port is not None:
        config["replay_endpoint"] = f"tcp://*:{replay_port}"
    return json.dumps(config)


ENDPOINT_RE = r"tcp://[^\s:/,]+:\d{1,5}"
SOURCE_RE = rf"{ENDPOINT_RE}(,{ENDPOINT_RE})?"


def parse_source(spec: str) -> tuple[str, str | None]:
    """A worker's KV events as the router is told them, ``ENDPOINT[,REPLAY_ENDPOINT]``:
    where it publishes, and where it answers replays (if it does)."""
    endpoint, _, replay = spec.partition(",")
    return endpoint, replay or None


def source(endpoint: str, replay: str | None) -> str:
    return endpoint if replay is None else f"{endpoint},{replay}"


def add_kv_events_args(p: argparse.ArgumentParser) -> None:
    """The worker's ``--kv-events-endpoint`` and ``--kv-events-replay-endpoint``."""
    p.add_argument(
        "--kv-events-endpoint",
        default=None,
        metavar="tcp://HOST:PORT",
        help="publish the prefix cache's KV events (vLLM's format) on this ZMQ endpoint, "
        "for the router's kv-events policy (default: off)",
    )
    p.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        metavar="tcp://HOST:PORT",
        help="with --kv-events-endpoint: keep the last 10,000 event batches and resend them "
        "on request here (vLLM's replay_endpoint), so a subscriber that missed some catches up",
    )
