"""The free-block queue: exact eviction order under every operation."""

from __future__ import annotations

from splitserve.engine.free_queue import FreeQueue


def test_starts_in_block_order_and_pops_from_the_head():
    q = FreeQueue(4)
    assert list(q) == [0, 1, 2, 3] and len(q) == 4 and q.head() == 0
    q.remove(q.head())
    assert list(q) == [1, 2, 3] and 0 not in q and 1 in q


def test_takes_any_block_out_and_puts_it_back_at_either_end():
    q = FreeQueue(5)
    for b in (2, 0, 4):
        q.remove(b)
    assert list(q) == [1, 3] and len(q) == 2
    q.append(2)
    q.appendleft(4)
    q.append(0)
    assert list(q) == [4, 1, 3, 2, 0] and len(q) == 5
    q.move_to_front(0)
    assert list(q) == [0, 4, 1, 3, 2] and q.head() == 0


def test_empties_and_refills():
    q = FreeQueue(2)
    q.remove(0)
    q.remove(1)
    assert list(q) == [] and not q
    q.append(1)
    q.appendleft(0)
    assert list(q) == [0, 1]


def test_pop_head_takes_the_first_in_line():
    q = FreeQueue(3)
    q.move_to_front(2)
    assert q.pop_head() == 2 and q.pop_head() == 0 and list(q) == [1]


def test_random_operations_keep_the_order_a_plain_list_keeps():
    import random

    rng = random.Random(7)
    for n in (1, 3, 300, 1000):  # past 256: links that are not small cached ints
        q, ref, out = FreeQueue(n), list(range(n)), []
        for _ in range(3000):
            op = rng.randrange(4)
            if op == 0 and ref:
                b = rng.choice(ref)
                q.remove(b)
                ref.remove(b)
                out.append(b)
            elif op == 1 and ref:
                b = ref.pop(0)
                assert q.pop_head() == b
                out.append(b)
            elif out:
                b = out.pop(rng.randrange(len(out)))
                if op == 2:
                    q.append(b)
                    ref.append(b)
                else:
                    q.appendleft(b)
                    ref.insert(0, b)
            assert len(q) == len(ref)
        assert list(q) == ref and all((b in q) == (b in ref) for b in range(n))


def test_queues_of_different_sizes_share_their_link_objects_and_stay_apart():
    small, large = FreeQueue(300), FreeQueue(600)
    small.remove(299)
    small.appendleft(299)
    assert list(small) == [299, *range(299)] and list(large) == list(range(600))
    assert small.head() is large._ids[299]
