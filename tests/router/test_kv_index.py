"""The router's index of which blocks each worker holds, fed by the workers' KV events."""

from __future__ import annotations

import asyncio
import contextlib
import time

import zmq
import zmq.asyncio

from splitserve.common.kv_events import (
    AllBlocksCleared,
    BlockEventSink,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventPublisher,
    first_block_salt,
    salted_extra_keys,
    subscribe,
)
from splitserve.common.kv_hash import hash_blocks, root_hash, split_salt
from splitserve.engine.block_manager import BlockManager
from splitserve.router.kv_index import ROOT, KVEventSubscriber, KVIndex, chain_root
from tests.engine.test_block_manager_events import admit

BS = 4
W1, W2 = "http://w1", "http://w2"
TOKENS = list(range(100, 120))  # 5 blocks of 4
OURS = hash_blocks(TOKENS, ROOT, BS)


def stored(theirs: list[int], parent: int | None, first_block: int, salt: str = "") -> BlockStored:
    tokens = TOKENS[first_block * BS : (first_block + len(theirs)) * BS]
    return BlockStored(
        theirs, parent, tokens, BS, None, "GPU", None, salted_extra_keys(len(theirs), salt)
    )


def removed(*theirs: int) -> BlockRemoved:
    return BlockRemoved(list(theirs), "GPU")


def batch(*events) -> EventBatch:
    return EventBatch(0.0, list(events), 0)


def held(index: KVIndex, url: str = W1) -> set[bytes]:
    return set(index.workers[url].held)


def test_a_stored_run_from_the_root_is_indexed_under_our_chain_hashes():
    index = KVIndex()
    index.apply(W1, 0, batch(stored([901, 902], None, 0)))
    assert held(index) == set(OURS[:2])


def test_a_run_chains_through_its_parent_by_the_workers_hash():
    index = KVIndex()
    index.apply(W1, 0, batch(stored([901, 902], None, 0)))
    index.apply(W1, 1, batch(stored([903, 904], 902, 2)))
    assert held(index) == set(OURS[:4])
    # The worker's hashes are its own business: another worker's numbers map the same.
    index.apply(W2, 0, batch(stored([5, 6, 7], None, 0)))
    assert held(index, W2) == set(OURS[:3])


def test_a_run_with_an_unknown_parent_is_left_out():
    index = KVIndex()
    index.apply(W1, 0, batch(stored([903], 902, 2)))
    assert held(index) == set() and index.stats.orphans == 1


def test_removed_blocks_leave_the_index_and_shorten_the_match():
    index = KVIndex()
    index.apply(W1, 0, batch(stored([901, 902, 903, 904], None, 0)))
    prompt = TOKENS + [1]  # 21 tokens: all 5 full blocks usable
    assert index.matches([W1, W2], prompt) == {W1: 16, W2: 0}
    index.apply(W1, 1, batch(removed(903)))
    assert held(index) == {OURS[0], OURS[1], OURS[3]}
    assert index.matches([W1], prompt) == {W1: 8}  # a hole ends the prefix


def test_a_hash_stored_twice_is_held_until_removed_twice():
    index = KVIndex()
    index.apply(W1, 0, batch(stored([901], None, 0), stored([901], None, 0)))
    index.apply(W1, 1, batch(removed(901)))
    assert held(index) == {OURS[0]}
    index.apply(W1, 2, batch(removed(901), removed(901)))  # the second is unknown: ignored
    assert held(index) == set()


def test_two_worker_hashes_of_the_same_tokens_are_one_block_held_twice():
    index = KVIndex()
    index.apply(W1, 0, batch(stored([901], None, 0), stored([777], None, 0)))
    index.apply(W1, 1, batch(removed(901)))
    assert held(index) == {OURS[0]}
    index.apply(W1, 2, batch(removed(777)))
    assert held(index) == set()


def test_all_blocks_cleared_empties_the_worker():
    index = KVIndex()
    index.apply(W1, 0, batch(stored([901, 902], None, 0)))
    index.apply(W2, 0, batch(stored([901], None, 0)))
    index.apply(W1, 1, batch(AllBlocksCleared(), stored([1], None, 0)))
    assert held(index) == {OURS[0]} and held(index, W2) == {OURS[0]}


def test_a_sequence_gap_forgets_the_worker_and_relearns_from_there():
    index = KVIndex()
    index.apply(W1, 0, batch(stored([901, 902], None, 0)))
    index.apply(W1, 2, batch(stored([903], 902, 2), stored([1], None, 0)))  # #1 was lost
    assert held(index) == {OURS[0]}  # 903's parent went with the rest
    assert (index.stats.gaps, index.stats.orphans) == (1, 1)
    index.apply(W1, 3, batch(stored([2], 1, 1)))
    assert held(index) == set(OURS[:2]) and index.stats.gaps == 1


def test_a_restarted_worker_numbering_from_zero_is_forgotten():
    index = KVIndex()
    index.apply(W1, 0, batch(stored([901], None, 0)))
    index.apply(W1, 1, batch(stored([902], 901, 1)))
    index.apply(W1, 0, batch(stored([50], None, 0)))
    assert held(index) == {OURS[0]} and index.stats.gaps == 1


def test_the_first_message_seen_may_have_any_number():
    index = KVIndex()
    index.apply(W1, 41, batch(stored([901], None, 0)))
    index.apply(W1, 42, batch(stored([902], 901, 1)))
    assert held(index) == set(OURS[:2]) and index.stats.gaps == 0


def test_matches_count_only_blocks_a_worker_could_reuse():
    index = KVIndex()
    index.apply(W1, 0, batch(stored([1, 2, 3, 4, 5], None, 0)))
    # 20 tokens: the last block holds the last token, which is always computed.
    assert index.matches([W1], TOKENS) == {W1: 16}
    assert index.matches([W1], TOKENS[:9]) == {W1: 8}
    assert index.matches([W1], TOKENS[:4]) == {W1: 0}
    assert index.matches([W1], [7] + TOKENS) == {W1: 0}


def test_a_second_block_size_from_one_worker_is_left_out():
    index = KVIndex()
    index.apply(W1, 0, batch(stored([901], None, 0)))
    index.apply(W1, 1, batch(BlockStored([5], None, TOKENS[:8], 8, None, "GPU", None)))
    assert held(index) == {OURS[0]} and index.stats.orphans == 1


def test_forget_drops_a_worker():
    index = KVIndex()
    index.apply(W1, 0, batch(stored([901], None, 0)))
    index.forget(W1)
    assert W1 not in index.workers and index.matches([W1], TOKENS) == {W1: 0}


async def until(check, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def test_the_subscriber_feeds_the_index_and_forgets_a_worker_that_goes_away():
    async def scenario() -> None:
        pub = EventPublisher("tcp://127.0.0.1:0", topic="w1")
        index = KVIndex()
        subscriber = KVEventSubscriber(index, {W1: pub.endpoint}, topic="w1")
        subscriber.start()
        try:
            await until(lambda: W1 in subscriber.connected, what="the connection")
            # Past the handshake the subscription may still be on its way: repeat a
            # harmless event until one lands.
            while W1 not in index.workers:
                pub.emit(AllBlocksCleared())
                await asyncio.sleep(0.05)
            pub.emit(stored([901, 902], None, 0))
            await until(lambda: held(index) == set(OURS[:2]), what="the stored blocks")
            assert index.stats.gaps == 0
            pub.close()
            await until(lambda: W1 not in index.workers, what="the worker to be forgotten")
            assert W1 not in subscriber.connected
        finally:
            await subscriber.stop()

    asyncio.run(scenario())


def test_a_salted_chain_is_indexed_apart_and_found_only_with_its_salt():
    # Two tenants' equal tokens are two chains, in the workers and in the index.
    index = KVIndex()
    index.apply(W1, 0, batch(stored([901, 902], None, 0, salt="alice"), stored([903], 902, 2)))
    index.apply(W2, 0, batch(stored([801, 802, 803], None, 0)))
    assert held(index) == set(hash_blocks(TOKENS[: 3 * BS], chain_root("alice"), BS))
    assert index.matches([W1, W2], TOKENS, "alice") == {W1: 3 * BS, W2: 0}
    assert index.matches([W1, W2], TOKENS) == {W1: 0, W2: 3 * BS}
    assert index.matches([W1, W2], TOKENS, "bob") == {W1: 0, W2: 0}


def test_the_salt_is_read_past_a_lora_name_as_vllm_orders_extra_keys():
    index = KVIndex()
    event = stored([901], None, 0)
    event.lora_name, event.extra_keys = "adapter", [("adapter", ("img", 3), "alice")]
    assert first_block_salt(event) == "alice"
    event.extra_keys = [("adapter", "alice")]
    index.apply(W1, 0, batch(event))
    assert index.matches([W1], TOKENS[:8], "alice", model="adapter") == {W1: BS}


def lora_run(theirs: list[int], parent: int | None, first_block: int, lora: str) -> BlockStored:
    """A stored run of LoRA adapter ``lora``: vLLM names it in every block's extra keys."""
    event = stored(theirs, parent, first_block)
    event.lora_id, event.lora_name, event.extra_keys = 1, lora, [(lora,)] * len(theirs)
    return event


def test_an_adapters_blocks_match_only_requests_for_that_adapter():
    index = KVIndex()
    index.apply(W1, 0, batch(lora_run([901, 902], None, 0, "sql"), lora_run([903], 902, 2, "sql")))
    index.apply(W2, 0, batch(stored([801, 802, 803], None, 0)))
    prompt = TOKENS[: 3 * BS + 1]
    assert index.matches([W1, W2], prompt, model="sql") == {W1: 3 * BS, W2: 0}
    assert index.matches([W1, W2], prompt, model="base") == {W1: 0, W2: 3 * BS}
    assert index.matches([W1, W2], prompt) == {W1: 0, W2: 3 * BS}
    assert index.matches([W1], prompt, model="other-adapter") == {W1: 0}
    assert index.loras == {"sql"}


def test_an_adapters_salted_chain_needs_both_the_adapter_and_the_salt():
    index = KVIndex()
    event = lora_run([901, 902], None, 0, "sql")
    event.extra_keys = [("sql", "alice"), ("sql",)]
    index.apply(W1, 0, batch(event))
    prompt = TOKENS[: 2 * BS + 1]
    assert index.matches([W1], prompt, "alice", model="sql") == {W1: 2 * BS}
    assert index.matches([W1], prompt, model="sql") == {W1: 0}
    assert index.matches([W1], prompt, "alice") == {W1: 0}


def test_blocks_holding_an_image_are_never_matched_by_text():
    # vLLM names an image in each block it covers, as (identifier, offset): equal
    # placeholder tokens of two images are two blocks, which the router cannot name.
    index = KVIndex()
    event = stored([901, 902, 903], None, 0)
    event.extra_keys = [None, (("img-a", 2),), None]
    index.apply(W1, 0, batch(event))
    other = stored([801, 802, 803], None, 0)
    other.extra_keys = [None, (("img-b", 2),), None]
    index.apply(W2, 0, batch(other))
    assert index.matches([W1, W2], TOKENS) == {W1: BS, W2: BS}  # up to the image
    h1, h2 = (index.workers[w]._ours[x][0] for w, x in ((W1, 902), (W2, 802)))
    assert h1 != h2 and h1 != OURS[1]


class Collected:
    """What a worker's block manager publishes, kept in order."""

    def __init__(self) -> None:
        self.events: list = []

    def emit(self, event) -> None:
        self.events.append(event)


def test_a_split_chain_is_indexed_as_the_worker_hashed_it():
    # A key's prompt whose first 9 tokens are its tenant's public prefix: the worker's events
    # name the switch block's salt, and the index hashes the prompt with the same split.
    def run(salt: str, tokens: list[int], engine: BlockManager, rid: str) -> None:
        root = root_hash("test-model", salt)
        engine.note_salt(root, salt)
        admit(engine, tokens, rid, root)

    alice = split_salt("public", 9, "alice")  # blocks 0 and 1 are public
    bob = split_salt("public", 9, "bob")
    out = Collected()
    engine = BlockManager(16, BS)
    engine.events = BlockEventSink(out, BS)
    run(alice, TOKENS[:6], engine, "a0")  # one block first, then the rest of the chain
    run(alice, TOKENS, engine, "a1")
    index = KVIndex()
    index.apply(W1, 0, batch(*out.events))
    assert [first_block_salt(e) for e in out.events] == ["public", "", "alice"]
    assert index.matches([W1], TOKENS + [1], alice) == {W1: 5 * BS}
    assert index.matches([W1], TOKENS + [1], bob) == {W1: 2 * BS}  # the public blocks only
    assert index.matches([W1], TOKENS + [1], "alice") == {W1: 0}
    run(bob, TOKENS, engine, "b")  # bob's own blocks after the two he found
    index.apply(W1, 1, batch(*out.events[3:]))
    assert first_block_salt(out.events[3]) == "bob" and out.events[3].parent_block_hash
    assert index.matches([W1], TOKENS + [1], bob) == {W1: 5 * BS}


class LossyLink:
    """A real ZMQ hop between a publisher and the subscriber that drops the messages
    numbered in ``drop``: what a slow subscriber past its high-water mark loses."""

    def __init__(self, upstream: str, drop: set[int]) -> None:
        self.drop = drop
        self.context = zmq.asyncio.Context()
        self.sub = subscribe(self.context, upstream)
        self.pub = self.context.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:0")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.forwarded: list[int] = []
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            frames = await self.sub.recv_multipart()
            seq = int.from_bytes(frames[1], "big")
            if seq not in self.drop:
                self.forwarded.append(seq)
                await self.pub.send_multipart(frames)

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.context.destroy(linger=0)


async def until_joined(pub: EventPublisher, condition, what: str) -> None:
    """Harmless batches (a block nobody holds removed) until ``condition``: past ZMQ's
    slow-joiner window."""
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        pub.emit(removed(1))
        await asyncio.sleep(0.05)


async def settled(pub: EventPublisher, index: KVIndex) -> None:
    """Until every batch sent has reached the index."""
    await until(lambda: index.expected(W1) == pub.batches_sent, what="the batches in flight")


def replaying_publisher(**kwargs) -> EventPublisher:
    return EventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", **kwargs)


def emit_each(pub: EventPublisher, *events) -> None:
    """One batch per event."""
    for event in events:
        sent = pub.batches_sent
        pub.emit(event)
        deadline = time.monotonic() + 5
        while pub.batches_sent == sent:
            assert time.monotonic() < deadline
            time.sleep(0.002)


@contextlib.asynccontextmanager
async def behind_a_lossy_link(**publisher):
    """A replaying publisher, a lossy hop, and an index subscribed through the hop (and to
    the publisher's replay endpoint), past the first batches: ``(pub, link, index)``."""
    pub = replaying_publisher(**publisher)
    link = LossyLink(pub.endpoint, drop=set())
    index = KVIndex()
    subscriber = KVEventSubscriber(index, {W1: f"{link.endpoint},{pub.replay_endpoint}"})
    subscriber.start()
    try:
        await until_joined(pub, lambda: W1 in index.workers, "the first batch")
        await settled(pub, index)
        yield pub, link, index
    finally:
        await subscriber.stop()
        await link.close()
        pub.close()


def test_a_gap_is_filled_from_the_workers_replay():
    async def scenario() -> None:
        async with behind_a_lossy_link() as (pub, link, index):
            first, replayed = pub.batches_sent, index.stats.replayed
            link.drop.update(range(first, first + 3))  # the three stored runs are lost
            emit_each(pub, stored([901], None, 0), stored([902], 901, 1), stored([903], 902, 2))
            pub.emit(stored([904], 903, 3))
            await until(lambda: held(index) == set(OURS[:4]), what="all four blocks")
            assert (index.stats.gaps, index.stats.replayed - replayed) == (0, 3)
            assert not set(link.forwarded) & link.drop

    asyncio.run(scenario())


def test_a_gap_past_what_the_worker_keeps_forgets_the_rest():
    async def scenario() -> None:
        async with behind_a_lossy_link(replay_buffer=2) as (pub, link, index):
            emit_each(pub, stored([901], None, 0))
            await until(lambda: held(index) == {OURS[0]}, what="the first block")
            first = pub.batches_sent
            link.drop.update(range(first, first + 2))
            emit_each(pub, stored([902], 901, 1), stored([903], 902, 2))
            pub.emit(removed(1))  # the replay keeps only 903's batch and this one
            await until(lambda: index.stats.gaps == 1, what="the gap")
            await until(lambda: index.expected(W1) == first + 3, what="the live batch")
            # Forgotten, then relearned from the kept batch: 903's parent is unknown.
            assert held(index) == set() and index.stats.orphans == 1

    asyncio.run(scenario())


def test_a_late_subscriber_learns_what_was_published_before_it_joined():
    async def scenario() -> None:
        pub = replaying_publisher()
        emit_each(pub, stored([901, 902, 903], None, 0), removed(903), removed(902))
        index = KVIndex()
        subscriber = KVEventSubscriber(index, {W1: f"{pub.endpoint},{pub.replay_endpoint}"})
        subscriber.start()
        try:
            await until_joined(pub, lambda: W1 in index.workers, "the first batch")
            assert held(index) == {OURS[0]} and index.stats.replayed >= 3
        finally:
            await subscriber.stop()
            pub.close()

    asyncio.run(scenario())


def test_without_a_replay_a_late_subscriber_knows_only_what_came_after():
    async def scenario() -> None:
        pub = EventPublisher("tcp://127.0.0.1:0")
        emit_each(pub, stored([901, 902], None, 0))
        index = KVIndex()
        subscriber = KVEventSubscriber(index, {W1: pub.endpoint})
        subscriber.start()
        try:
            await until_joined(pub, lambda: W1 in index.workers, "the first batch")
            assert held(index) == set() and index.stats.replayed == 0
        finally:
            await subscriber.stop()
            pub.close()

    asyncio.run(scenario())
