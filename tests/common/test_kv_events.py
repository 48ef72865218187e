"""KV events in vLLM 0.32's wire format: the codec, the framing, the publisher, and (when
``.venv-vllm`` is there) bytes checked against vLLM's own classes and publisher."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio

from splitserve.cluster.local import free_port
from splitserve.common.kv_events import (
    AllBlocksCleared,
    BlockEventSink,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventPublisher,
    decode_batch,
    decode_message,
    encode_batch,
    fetch_replay,
    parse_source,
    subscribe,
    vllm_kv_events_config,
)

VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"


def sample_batch() -> EventBatch:
    return EventBatch(
        1234.5,
        [
            BlockStored([11, 12], None, [1, 2, 3, 4], 2, None, "GPU", None),
            BlockStored([b"\x01" * 16], 12, [5, 6], 2, None, "GPU", None, group_idx=0),
            BlockStored([13], 11, [7, 8], 2, 3, "GPU", "lora-a", extra_keys=[("lora-a", "salt")]),
            BlockRemoved([12, b"\x01" * 16], "GPU"),
            AllBlocksCleared(),
        ],
        0,
    )


def test_a_batch_round_trips():
    batch = sample_batch()
    assert decode_batch(encode_batch(batch)) == batch


def test_the_layout_is_vllms_array_of_tagged_maps_without_defaults():
    plain = msgspec.msgpack.decode(encode_batch(sample_batch()))
    ts, events, rank = plain
    assert (ts, rank) == (1234.5, 0)
    assert list(events[0]) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ]
    assert events[1]["group_idx"] == 0 and "extra_keys" not in events[1]
    assert events[2]["extra_keys"] == [["lora-a", "salt"]]
    assert events[3] == {
        "type": "BlockRemoved",
        "block_hashes": [12, b"\x01" * 16],
        "medium": "GPU",
    }
    assert events[4] == {"type": "AllBlocksCleared"}


def test_unknown_event_types_and_fields_are_skipped_not_fatal():
    stored = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": [1, 2],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "some_future_field": 7,
    }
    payload = msgspec.msgpack.encode([2.0, [{"type": "BlockPromoted", "x": 1}, stored], None])
    batch = decode_batch(payload)
    assert batch.events == [BlockStored([1], None, [1, 2], 2, None, "GPU", None)]
    assert batch.data_parallel_rank is None


def test_malformed_messages_are_value_errors():
    good = encode_batch(sample_batch())
    with pytest.raises(ValueError):
        decode_message([b"", good])
    with pytest.raises(ValueError):
        decode_message([b"", b"\x00" * 4, good])
    with pytest.raises(ValueError):
        decode_message([b"", b"\x00" * 8, b"\xc1not msgpack"])
    assert decode_message([b"t", (5).to_bytes(8, "big"), good]) == (5, sample_batch())


def receive(sock: zmq.Socket, timeout_s: float = 10.0) -> list[bytes]:
    if not sock.poll(int(timeout_s * 1000)):
        raise TimeoutError("no KV event message arrived")
    return sock.recv_multipart()


def connected_pair(topic: str = "") -> tuple[EventPublisher, zmq.Socket]:
    """A publisher and a subscriber past ZMQ's slow-joiner window: probe events are sent
    until one arrives, so later messages are not lost to a subscription still in flight."""
    pub = EventPublisher("tcp://127.0.0.1:0", topic=topic)
    sub = subscribe(zmq.Context.instance(), pub.endpoint, topic)
    deadline = time.monotonic() + 10
    while not sub.poll(50):
        assert time.monotonic() < deadline, "the subscription never took"
        pub.emit(AllBlocksCleared())
    while sub.poll(200):  # the probes still in flight
        sub.recv_multipart()
    return pub, sub


def test_publisher_frames_and_numbers_batches_as_vllm_does():
    pub, sub = connected_pair("kv@w1")
    try:
        events = [BlockRemoved([i], "GPU") for i in range(6)]
        for event in events[:3]:  # one at a time: a batch each
            pub.emit(event)
            frames = receive(sub)
            assert frames[0] == b"kv@w1" and len(frames[1]) == 8
        for event in events[3:]:  # at once: batched as they queued up
            pub.emit(event)
        seqs, got = [], []
        while len(got) < 3:
            seq, batch = decode_message(receive(sub))
            seqs.append(seq)
            got += batch.events
            assert batch.data_parallel_rank == 0 and batch.ts > 0
        assert got == events[3:]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        assert seqs[-1] == pub.batches_sent - 1
    finally:
        sub.close(linger=0)
        pub.close()


def test_publisher_on_a_taken_port_is_a_clear_error():
    pub = EventPublisher("tcp://127.0.0.1:0")
    try:
        with pytest.raises(ValueError, match="cannot publish KV events"):
            EventPublisher(pub.endpoint)
    finally:
        pub.close()


def test_the_sink_speaks_for_the_block_manager():
    pub, sub = connected_pair()
    try:
        sink = BlockEventSink(pub, block_size=2)
        sink.stored([b"h1", b"h2"], b"h0", [(1, 2), (3, 4)])
        sink.removed(b"h1")
        sink.cleared()
        got: list = []
        while len(got) < 3:
            got += decode_message(receive(sub))[1].events
        assert got == [
            BlockStored([b"h1", b"h2"], b"h0", [1, 2, 3, 4], 2, None, "GPU", None),
            BlockRemoved([b"h1"], "GPU"),
            AllBlocksCleared(),
        ]
    finally:
        sub.close(linger=0)
        pub.close()


def test_vllm_config_binds_a_wildcard_endpoint():
    assert json.loads(vllm_kv_events_config(5557, "t")) == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
        "topic": "t",
    }


# What the vLLM side runs: read our bytes with vLLM's classes and write them back, then
# publish with vLLM's own ZmqEventPublisher until stopped.
VLLM_SIDE = """
import json, sys, time
import msgspec
from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

ours = bytes.fromhex(sys.argv[1])
batch = msgspec.msgpack.decode(ours, type=KVEventBatch)
again = msgspec.msgpack.encode(batch)
print(json.dumps({"same_bytes": again == ours, "fields": msgspec.to_builtins(batch)}), flush=True)
pub = ZmqEventPublisher(0, endpoint=f"tcp://*:{sys.argv[2]}", topic="vllm")
for i in range(1200):
    pub.publish(KVEventBatch(ts=float(i), events=batch.events[:1]))
    time.sleep(0.05)
"""


@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm with vLLM")
def test_vllm_reads_our_bytes_and_we_read_its_publisher():
    ours = encode_batch(sample_batch())
    port = free_port()
    sub = subscribe(zmq.Context.instance(), f"tcp://127.0.0.1:{port}", "vllm")
    proc = subprocess.Popen(
        [str(VLLM_PYTHON), "-c", VLLM_SIDE, ours.hex(), str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line, f"the vLLM side failed (exit code {proc.poll()})"
        report = json.loads(line)
        assert report["same_bytes"]
        assert report["fields"] == json.loads(json.dumps(msgspec.to_builtins(sample_batch())))
        messages = [decode_message(receive(sub, 60)) for _ in range(3)]
        seqs = [seq for seq, _ in messages]
        assert seqs == list(range(seqs[0], seqs[0] + 3))
        for _, batch in messages:
            assert batch.events == sample_batch().events[:1]
            assert batch.data_parallel_rank == 0
    finally:
        proc.kill()
        proc.wait(10)
        sub.close(linger=0)


def replay(endpoint: str, start: int, timeout: float = 5.0):
    async def ask():
        context = zmq.asyncio.Context()
        try:
            return await fetch_replay(context, endpoint, start, timeout)
        finally:
            context.destroy(linger=0)

    return asyncio.run(ask())


def publish(pub: EventPublisher, count: int) -> None:
    """``count`` batches, one event each, numbered 0.. (waits until each is sent)."""
    for i in range(count):
        pub.emit(BlockRemoved([i], "GPU"))
        deadline = time.monotonic() + 5
        while pub.batches_sent <= i:
            assert time.monotonic() < deadline
            time.sleep(0.002)


def test_a_replay_resends_the_kept_batches_from_a_number_on():
    pub = EventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    try:
        publish(pub, 6)
        got = replay(pub.replay_endpoint, 2)
        assert [n for n, _ in got] == [2, 3, 4, 5]
        assert [b.events[0].block_hashes for _, b in got] == [[2], [3], [4], [5]]
        assert replay(pub.replay_endpoint, 6) == []  # nothing newer yet
    finally:
        pub.close()


def test_a_replay_keeps_only_the_last_batches():
    pub = EventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", replay_buffer=3)
    try:
        publish(pub, 7)
        assert [n for n, _ in replay(pub.replay_endpoint, 0)] == [4, 5, 6]
    finally:
        pub.close()


def test_a_replay_endpoint_that_does_not_answer_is_none_within_the_timeout():
    started = time.monotonic()
    assert replay(f"tcp://127.0.0.1:{free_port()}", 0, timeout=0.3) is None
    assert time.monotonic() - started < 3


def test_the_vllm_config_names_the_replay_endpoint():
    config = json.loads(vllm_kv_events_config(5557, replay_port=5558))
    assert config["replay_endpoint"] == "tcp://*:5558" and config["endpoint"] == "tcp://*:5557"
    assert parse_source("tcp://h:1,tcp://h:2") == ("tcp://h:1", "tcp://h:2")
    assert parse_source("tcp://h:1") == ("tcp://h:1", None)


# vLLM's publisher with a replay endpoint: five batches, then idle until stopped.
VLLM_REPLAY_SIDE = """
import sys, time
from vllm.distributed.kv_events import BlockRemoved, KVEventBatch, ZmqEventPublisher

pub = ZmqEventPublisher(
    0, endpoint=f"tcp://*:{sys.argv[1]}", replay_endpoint=f"tcp://*:{sys.argv[2]}"
)
for i in range(5):
    pub.publish(KVEventBatch(ts=float(i), events=[BlockRemoved(block_hashes=[i], medium="GPU")]))
print("published", flush=True)
time.sleep(120)
"""


@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm with vLLM")
def test_we_fetch_a_replay_from_vllms_publisher():
    port, replay_port = free_port(), free_port()
    proc = subprocess.Popen(
        [str(VLLM_PYTHON), "-c", VLLM_REPLAY_SIDE, str(port), str(replay_port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout.readline() == "published\n", f"exit code {proc.poll()}"
        deadline = time.monotonic() + 30
        while True:  # its thread publishes (and keeps) what was queued shortly after
            got = replay(f"tcp://127.0.0.1:{replay_port}", 2)
            if got is not None and len(got) == 3 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert [n for n, _ in got] == [2, 3, 4]
        assert [b.events[0].block_hashes for _, b in got] == [[2], [3], [4]]
    finally:
        proc.kill()
        proc.wait(10)
