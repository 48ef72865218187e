"""The worker's stored responses (``store: true``), per tenant, for ``previous_response_id``
and ``GET``/``DELETE /v1/responses/{id}``.

Each stored response keeps the conversation through its own output as chat messages, so a
turn that continues it needs nothing else, and deleting one response never breaks another
(the messages are shared by reference, not copied). A tenant sees only its own responses:
the store is looked up by (tenant, id), and an id of another tenant is simply not found.

Bounds: at most ``max_per_tenant`` responses per tenant; past that the least recently used
one (stored, continued or fetched) is forgotten, as if deleted by its owner. The store is in
memory: a worker restart forgets every chain (its KV may survive in the disk tier).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_PER_TENANT = 1024


@dataclass(frozen=True, slots=True)
class StoredResponse:
    id: str
    chain: str
    body: dict[str, Any]  # the response object, as ``GET`` returns it
    context: tuple[dict[str, Any], ...]  # the conversation through this output, no instructions


class ResponseStore:
    def __init__(self, max_per_tenant: int = DEFAULT_MAX_PER_TENANT) -> None:
        if max_per_tenant < 1:
            raise ValueError("the response store must hold at least one response per tenant")
        self.max_per_tenant = max_per_tenant
        self._tenants: dict[str, OrderedDict[str, StoredResponse]] = {}
        self.evicted = 0

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        held = self._tenants.get(tenant)
        record = None if held is None else held.get(response_id)
        if record is not None:
            held.move_to_end(response_id)  # type: ignore[union-attr]
        return record

    def put(self, tenant: str, record: StoredResponse) -> None:
        held = self._tenants.setdefault(tenant, OrderedDict())
        held[record.id] = record
        held.move_to_end(record.id)
        while len(held) > self.max_per_tenant:
            held.popitem(last=False)
            self.evicted += 1

    def delete(self, tenant: str, response_id: str) -> bool:
        held = self._tenants.get(tenant)
        if held is None or held.pop(response_id, None) is None:
            return False
        if not held:
            del self._tenants[tenant]
        return True

    def __len__(self) -> int:
        return sum(len(held) for held in self._tenants.values())
