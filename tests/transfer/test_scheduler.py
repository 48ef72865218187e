"""Scheduler-side half: kv_transfer_params round trip and validation, exact load plans."""

from __future__ import annotations

import pytest

from splitserve.transfer import IncompatibleKV, KVConnectorScheduler, RemoteKV
from splitserve.transfer import build_transfer_params as build
from tests.transfer.helpers import chain

HASHES = chain(6)


def params(**overrides: object) -> dict:
    base = build(
        engine_id="p0", request_id="req-1", block_ids=[10, 11, 12, 13, 14, 15, 16],
        block_hashes=HASHES, host="10.0.0.5", port=7000, transport="tcp", block_size=4,
        num_tokens=27, model_id="m", kv_dtype="float32", kv_block_shape=[2, 2, 4, 2, 8],
    )  # fmt: skip
    base.update(overrides)
    return base


def test_params_use_vllm_names_and_round_trip() -> None:
    p = params()
    assert p["do_remote_prefill"] is True and p["do_remote_decode"] is False
    assert p["remote_block_ids"] == [10, 11, 12, 13, 14, 15, 16]
    assert p["block_hashes"] == [h.hex() for h in HASHES]
    remote = RemoteKV.from_params(p)
    assert remote.block_hashes == tuple(HASHES) and remote.port == 7000
    assert remote.to_params() == p


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"do_remote_prefill": False}, "do_remote_prefill"),
        ({"remote_port": "7000"}, "remote_port must be int"),
        ({"remote_port": True}, "remote_port must be int"),
        ({"remote_port": 70000}, "remote_port must be in"),
        ({"remote_request_id": None}, "remote_request_id must be str"),
        ({"remote_block_ids": [1, "2"]}, "remote_block_ids must be a list of ints"),
        ({"block_hashes": ["zz"]}, "hex strings"),
        ({"block_hashes": ["ab" * 8] * 8}, "8 block_hashes for 7"),
        ({"block_hashes": ["ab" * 4]}, "block hash length"),
        ({"kv_dtype": "int4"}, "kv_dtype"),
    ],
)
def test_from_params_rejects_bad_fields(override: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RemoteKV.from_params(params(**override))


def test_plan_loads_only_missing_blocks_including_partial_tail() -> None:
    remote = RemoteKV.from_params(params())  # 7 blocks, 6 hashed: block 6 is partial
    plan = KVConnectorScheduler(4).plan_load(remote, set(HASHES[:3]))
    assert plan.hit_indices == (0, 1, 2)
    assert plan.load_indices == (3, 4, 5, 6)
    assert plan.remote_block_ids == (13, 14, 15, 16)
    assert plan.hashes == (HASHES[3], HASHES[4], HASHES[5], None)
    assert plan.nbytes() == 4 * 2 * 2 * 4 * 2 * 8 * 4


def test_prefix_only_stops_at_first_miss_unless_disabled() -> None:
    remote = RemoteKV.from_params(params())
    held = {HASHES[0], HASHES[2], HASHES[3]}  # block 1 was evicted
    prefix = KVConnectorScheduler(4).plan_load(remote, held)
    assert (prefix.hit_indices, prefix.load_indices) == ((0,), (1, 2, 3, 4, 5, 6))
    anywhere = KVConnectorScheduler(4, prefix_only=False).plan_load(remote, held.__contains__)
    assert (anywhere.hit_indices, anywhere.load_indices) == ((0, 2, 3), (1, 4, 5, 6))


def test_everything_held_plans_nothing_but_the_tail() -> None:
    plan = KVConnectorScheduler(4).plan_load(RemoteKV.from_params(params()), set(HASHES))
    assert plan.load_indices == (6,)


def test_incompatible_layout_is_refused() -> None:
    remote = RemoteKV.from_params(params())
    for kwargs in ({"block_size": 16}, {"model_id": "other"}, {"kv_dtype": "bfloat16"}):
        size = kwargs.pop("block_size", 4)
        with pytest.raises(IncompatibleKV):
            KVConnectorScheduler(size, **kwargs).plan_load(remote, set())
    KVConnectorScheduler(4, model_id="m", kv_block_shape=(2, 2, 4, 2, 8)).plan_load(remote, set())
