"""The block-hash salt of one request, where its prompt matters: a key that shares its
tenant's public prefixes (``common/public_prefix.py``) hashes the whole blocks of the prefix
its prompt opens with under the tenant's public salt, and the rest under its own.

Workers and the router compute it the same way, from the principal, the ``cache_salt``, the
prompt's token ids and the keys file, with the same tokenizer: the router's KV-event index
then names the blocks the workers do. A request with a ``cache_salt`` asked for a cache of
its own and shares nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from splitserve.common.kv_hash import split_salt
from splitserve.common.public_prefix import ChatIds, TextIds, shared_tokens
from splitserve.common.tenants import Tenants, kv_salt, public_salt


class KVSalts:
    """Salts for one deployment's principals, with its tenants' public prefixes tokenized
    once (``text_ids`` and ``chat_ids`` tokenize as the engine does; None: no tokenizer,
    nothing is shared). A prefix the tokenizer cannot take is a ValueError at start."""

    def __init__(
        self,
        tenants: Tenants,
        secret: bytes,
        text_ids: TextIds | None = None,
        chat_ids: ChatIds | None = None,
    ) -> None:
        self.tenants = tenants
        self.secret = secret
        self._text_ids, self._chat_ids = text_ids, chat_ids
        self._prefix_ids = self._tokenized(tenants)

    def adopt(self, tenants: Tenants) -> None:
        """Switch to ``tenants``' keys and prefixes (a reloaded keys file); a prefix the
        tokenizer cannot take is a ValueError, and nothing changes."""
        prefix_ids = self._tokenized(tenants)
        self.tenants.adopt(tenants)
        self._prefix_ids = prefix_ids

    def _tokenized(self, tenants: Tenants) -> dict[str, list[list[int]]]:
        out: dict[str, list[list[int]]] = {}
        if self._text_ids is None or self._chat_ids is None:
            return out
        for tenant in {t.id: t for t in tenants.sharing.values()}.values():
            ids = []
            for i, prefix in enumerate(tenant.public_prefixes):
                try:
                    ids.append(prefix.token_ids(self._text_ids, self._chat_ids))
                except Exception as e:  # a chat template may reject the messages
                    raise ValueError(
                        f"tenant {tenant.id!r}: public prefix {i} cannot be tokenized: {e}"
                    ) from e
            out[tenant.id] = ids
        return out

    def salt(self, principal: str, cache_salt: str | None, prompt_ids: Sequence[int] | None) -> str:
        """The salt of ``principal``'s request for ``prompt_ids`` (None: not known, so the
        principal's own salt)."""
        own = kv_salt(self.secret, principal, cache_salt)
        tenant = self.tenants.sharing.get(principal)
        if tenant is None or cache_salt or not prompt_ids or tenant.id not in self._prefix_ids:
            return own
        shared = shared_tokens(prompt_ids, self._prefix_ids[tenant.id])
        return split_salt(public_salt(self.secret, tenant.id), shared, own) if shared else own
