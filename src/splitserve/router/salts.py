"""The KV salt of a request, as the router sees it (``common.kv_salts``).

Builtin workers derive the salt themselves from the principal the router signs (a tenant,
or one key of it) and the prompt. vLLM workers know no tenants, so the router hands them
the principal's salt as vLLM's own ``cache_salt`` (the client's folded in): tenants then
never share vLLM's prefix cache either, nor do separated keys, which on vLLM also share no
public prefix (its chain takes one salt). Either way the router knows the salt the workers
hash with, which its KV-event index needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from splitserve.common.kv_salts import KVSalts
from splitserve.common.tenants import kv_salt


def salt_for_vllm(body: dict[str, Any], principal: str, secret: bytes) -> bool:
    """Put the request's KV salt in ``body`` as ``cache_salt`` for a vLLM worker; True
    when ``body`` changed (the empty salt leaves it as it is)."""
    own = body.get("cache_salt")
    if own is not None and not isinstance(own, str):
        return False  # vLLM answers the malformed field with its own 400
    salt = kv_salt(secret, principal, own)
    if not salt:
        return False
    body["cache_salt"] = salt
    return True


def request_salt(
    body: dict[str, Any],
    principal: str,
    salts: KVSalts,
    engine: str,
    prompt_ids: Sequence[int] | None,
) -> str:
    """The salt the workers hash this request's blocks with: what a builtin worker derives
    from the signed principal and the prompt, or what ``salt_for_vllm`` put in a vLLM
    worker's body."""
    own = body.get("cache_salt")
    own = own if isinstance(own, str) else None
    if engine == "vllm":
        return own or ""
    return salts.salt(principal, own, prompt_ids)
