"""Response ids carry their chain; the router keys a chain's every turn alike from them; the
worker's response store is bounded per tenant and separates tenants."""

from __future__ import annotations

import pytest

from splitserve.common.access_log import usage_fields
from splitserve.common.responses_api import (
    CHAIN_HEADER,
    chain_of,
    chain_session,
    new_chain,
    response_id,
)
from splitserve.router.session import chain_key
from splitserve.worker.response_store import ResponseStore, StoredResponse


def test_every_id_of_a_chain_names_the_chain():
    chain = new_chain()
    ids = {response_id(chain) for _ in range(50)}
    assert len(ids) == 50 and all(chain_of(i) == chain for i in ids)
    assert all(len(i) == len("resp_") + 48 for i in ids)  # as long as OpenAI's


@pytest.mark.parametrize("bad", ["resp_abc", "resp_" + "g" * 48, "msg_" + "0" * 48, ""])
def test_foreign_ids_name_no_chain(bad):
    assert chain_of(bad) is None


def test_the_router_keys_a_continued_turn_by_its_chain_and_names_a_new_one():
    first, named = chain_key({"input": "hi"})
    chain = named[CHAIN_HEADER]
    assert first.key == chain_session(chain) and first.source == "response_chain"
    later, none = chain_key({"input": "more", "previous_response_id": response_id(chain)})
    assert later.key == first.key and none == {}
    again, _ = chain_key({"input": "hi"})
    assert again.key != first.key  # every first turn is a new chain
    foreign, none = chain_key({"previous_response_id": "resp_theirs"})
    assert foreign.key == "response:resp_theirs" and none == {}


def record(i: int) -> StoredResponse:
    return StoredResponse(f"resp_{i}", "c", {"id": f"resp_{i}"}, ())


def test_the_store_forgets_the_least_recently_used_response_of_a_tenant():
    store = ResponseStore(max_per_tenant=2)
    store.put("alice", record(1))
    store.put("alice", record(2))
    assert store.get("alice", "resp_1") is not None  # 1 is now the most recently used
    store.put("alice", record(3))
    assert store.get("alice", "resp_2") is None and store.evicted == 1
    store.put("bob", record(4))  # another tenant's responses do not count against alice
    assert store.get("alice", "resp_1") is not None and store.get("alice", "resp_3") is not None
    assert len(store) == 3


def test_a_tenant_never_sees_or_deletes_anothers_response():
    store = ResponseStore()
    store.put("alice", record(1))
    assert store.get("bob", "resp_1") is None
    assert store.delete("bob", "resp_1") is False
    assert store.delete("alice", "resp_1") is True and store.get("alice", "resp_1") is None
    with pytest.raises(ValueError):
        ResponseStore(max_per_tenant=0)


def test_the_access_log_reads_a_responses_usage():
    usage = {"input_tokens": 40, "input_tokens_details": {"cached_tokens": 32}, "output_tokens": 5}
    assert usage_fields(usage) == {"prompt_tokens": 40, "cached_tokens": 32, "completion_tokens": 5}
    chat = {
        "prompt_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens": 2,
    }
    assert usage_fields(chat) == {"prompt_tokens": 7, "cached_tokens": 0, "completion_tokens": 2}
