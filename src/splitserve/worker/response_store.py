"""The worker's stored responses (``store: true``), per tenant, for ``previous_response_id``
and ``GET``/``DELETE /v1/responses/{id}``.

Each stored response keeps the conversation through its own output as chat messages, so a
turn that continues it needs nothing else, and deleting one response never breaks another
(the messages are shared by reference, not copied). A tenant sees only its own responses:
the store is looked up by (tenant, id), and an id of another tenant is simply not found.

Bounds: at most ``max_per_tenant`` responses per tenant; past that the least recently used
one (stored, continued or fetched) is forgotten, as if deleted by its owner. The store is in
memory; with ``saved`` (a worker with a disk KV tier, ``saved_responses``) every change is
written to disk too and a miss is looked up there, so chains survive a worker restart as
their KV does. Erasing a tenant's KV forgets its responses.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from splitserve.worker.saved_responses import SavedResponses

DEFAULT_MAX_PER_TENANT = 1024


@dataclass(frozen=True, slots=True)
class StoredResponse:
    id: str
    chain: str
    body: dict[str, Any]  # the response object, as ``GET`` returns it
    context: tuple[dict[str, Any], ...]  # the conversation through this output, no instructions

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "chain": self.chain, "body": self.body, "context": self.context}

    @classmethod
    def of(cls, saved: dict[str, Any]) -> StoredResponse:
        return cls(saved["id"], saved["chain"], saved["body"], tuple(saved["context"]))


class ResponseStore:
    def __init__(
        self, max_per_tenant: int = DEFAULT_MAX_PER_TENANT, saved: SavedResponses | None = None
    ) -> None:
        if max_per_tenant < 1:
            raise ValueError("the response store must hold at least one response per tenant")
        self.max_per_tenant = max_per_tenant
        self.saved = saved
        self._tenants: dict[str, OrderedDict[str, StoredResponse]] = {}
        self.evicted = 0

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        held = self._tenants.get(tenant)
        record = None if held is None else held.get(response_id)
        if record is not None:
            held.move_to_end(response_id)  # type: ignore[union-attr]
            if self.saved is not None:
                self.saved.touch(tenant, response_id)
        elif self.saved is not None:  # stored before a restart, or not read since
            found = self.saved.load(tenant, response_id)
            if found is not None:
                record = StoredResponse.of(found)
                self._hold(tenant, record)
        return record

    def put(self, tenant: str, record: StoredResponse) -> None:
        if self.saved is not None:
            self.saved.save(tenant, record.as_dict())
        self._hold(tenant, record)

    def _hold(self, tenant: str, record: StoredResponse) -> None:
        held = self._tenants.setdefault(tenant, OrderedDict())
        held[record.id] = record
        held.move_to_end(record.id)
        while len(held) > self.max_per_tenant:
            gone, _ = held.popitem(last=False)
            if self.saved is not None:
                self.saved.delete(tenant, gone)
            self.evicted += 1

    def delete(self, tenant: str, response_id: str) -> bool:
        on_disk = self.saved is not None and self.saved.delete(tenant, response_id)
        held = self._tenants.get(tenant)
        if held is None or held.pop(response_id, None) is None:
            return on_disk
        if not held:
            del self._tenants[tenant]
        return True

    def forget_tenant(self, tenant: str) -> int:
        """Forget every response of ``tenant`` (its KV is being erased); how many."""
        held = self._tenants.pop(tenant, None) or {}
        on_disk = self.saved.forget_tenant(tenant) if self.saved is not None else 0
        return max(len(held), on_disk)

    def __len__(self) -> int:
        return sum(len(held) for held in self._tenants.values())
