"""The scheduler-side half of a KV connector: pure Python, no torch, no sockets.

It reads the ``kv_transfer_params`` a prefill worker answered with (vLLM's field names plus
splitserve's own), checks them against the local cache layout, and decides which blocks the
decode worker must pull: those it does not already hold by hash. Only the plain metadata it
builds (``LoadPlan``) crosses to the worker-side half that moves bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from splitserve.common.kv_hash import BlockHash
from splitserve.transfer.errors import IncompatibleKV

HASH_BYTES = 16
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
LocalHits = Collection[BlockHash] | Callable[[BlockHash], bool]


@dataclass(frozen=True, slots=True)
class RemoteKV:
    """Where a request's prefilled KV lives, as the prefill worker described it.

    ``block_hashes`` name the leading full blocks; the last block of a prompt may be partial
    and then has no hash (``len(block_hashes) <= len(block_ids)``).
    """

    engine_id: str
    request_id: str
    block_ids: tuple[int, ...]
    host: str
    port: int
    block_hashes: tuple[BlockHash, ...]
    transport: str
    block_size: int
    num_tokens: int | None = None
    model_id: str | None = None
    kv_dtype: str | None = None
    kv_block_shape: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _check(bool(self.request_id), "remote_request_id must be a non-empty string")
        _check(bool(self.host), "remote_host must be a non-empty string")
        _check(0 < self.port < 65536, f"remote_port must be in 1..65535, got {self.port}")
        _check(self.block_size > 0, f"block_size must be > 0, got {self.block_size}")
        _check(all(b >= 0 for b in self.block_ids), "remote_block_ids must be >= 0")
        _check(
            len(self.block_hashes) <= len(self.block_ids),
            f"{len(self.block_hashes)} block_hashes for {len(self.block_ids)} remote_block_ids",
        )
        _check(all(len(h) == HASH_BYTES for h in self.block_hashes), "bad block hash length")
        _check(self.kv_dtype is None or self.kv_dtype in DTYPE_BYTES, f"bad {self.kv_dtype=}")

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> RemoteKV:
        """Parse and validate the ``kv_transfer_params`` a prefill worker returned.

        Raises ``ValueError`` naming the first bad or missing field.
        """
        if not isinstance(params, Mapping):
            raise ValueError(f"kv_transfer_params must be an object, got {type(params).__name__}")
        if params.get("do_remote_prefill") is not True:
            raise ValueError("kv_transfer_params has no do_remote_prefill=true: not from a prefill")
        shape = params.get("kv_block_shape")
        return cls(
            engine_id=_get(params, "remote_engine_id", str),
            request_id=_get(params, "remote_request_id", str),
            block_ids=tuple(_int_list(params, "remote_block_ids")),
            host=_get(params, "remote_host", str),
            port=_get(params, "remote_port", int),
            block_hashes=tuple(_hashes(params)),
            transport=_get(params, "transport", str),
            block_size=_get(params, "block_size", int),
            num_tokens=_get(params, "num_tokens", int, required=False),
            model_id=_get(params, "model_id", str, required=False),
            kv_dtype=_get(params, "kv_dtype", str, required=False),
            kv_block_shape=None if shape is None else tuple(_int_list(params, "kv_block_shape")),
        )

    def to_params(self) -> dict[str, Any]:
        """The ``kv_transfer_params`` dict (JSON-ready) describing this KV."""
        params: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": self.request_id,
            "remote_block_ids": list(self.block_ids),
            "remote_host": self.host,
            "remote_port": self.port,
            "block_hashes": [h.hex() for h in self.block_hashes],
            "transport": self.transport,
            "block_size": self.block_size,
        }
        optional = {
            "num_tokens": self.num_tokens,
            "model_id": self.model_id,
            "kv_dtype": self.kv_dtype,
            "kv_block_shape": None if self.kv_block_shape is None else list(self.kv_block_shape),
        }
        params.update({k: v for k, v in optional.items() if v is not None})
        return params


def build_transfer_params(
    *,
    engine_id: str,
    request_id: str,
    block_ids: Sequence[int],
    block_hashes: Sequence[BlockHash],
    host: str,
    port: int,
    transport: str,
    block_size: int,
    num_tokens: int | None = None,
    model_id: str | None = None,
    kv_dtype: str | None = None,
    kv_block_shape: Sequence[int] | None = None,
) -> dict[str, Any]:
    """The prefill worker's answer: ``kv_transfer_params`` for the decode leg (validated)."""
    remote = RemoteKV(
        engine_id=engine_id,
        request_id=request_id,
        block_ids=tuple(block_ids),
        host=host,
        port=port,
        block_hashes=tuple(block_hashes),
        transport=transport,
        block_size=block_size,
        num_tokens=num_tokens,
        model_id=model_id,
        kv_dtype=kv_dtype,
        kv_block_shape=None if kv_block_shape is None else tuple(kv_block_shape),
    )
    return remote.to_params()


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """Which of a remote request's blocks to pull (by position in ``remote.block_ids``)."""

    remote: RemoteKV
    load_indices: tuple[int, ...]
    hit_indices: tuple[int, ...]

    @property
    def remote_block_ids(self) -> tuple[int, ...]:
        return tuple(self.remote.block_ids[i] for i in self.load_indices)

    @property
    def hashes(self) -> tuple[BlockHash | None, ...]:
        """The hash of each block to load, or None for the unhashed (partial) tail block."""
        hashes = self.remote.block_hashes
        return tuple(hashes[i] if i < len(hashes) else None for i in self.load_indices)

    @property
    def num_blocks(self) -> int:
        return len(self.load_indices)

    def nbytes(self) -> int | None:
        """Bytes the pull moves (payload only), when the remote gave its layout."""
        remote = self.remote
        if remote.kv_dtype is None or remote.kv_block_shape is None:
            return None
        per_block = DTYPE_BYTES[remote.kv_dtype]
        for dim in remote.kv_block_shape:
            per_block *= dim
        return per_block * self.num_blocks


class KVConnectorScheduler:
    """Answers "which blocks can be loaded from where" for one local cache layout.

    ``prefix_only`` (the default) matches the engine's prefix cache, which reuses only the
    leading run of cached blocks: after the first miss every block is loaded, even one that
    happens to be held locally, so the loaded and held blocks always tile the prompt.
    """

    def __init__(
        self,
        block_size: int,
        model_id: str | None = None,
        kv_dtype: str | None = None,
        kv_block_shape: Sequence[int] | None = None,
        prefix_only: bool = True,
    ) -> None:
        self.block_size = block_size
        self.model_id = model_id
        self.kv_dtype = kv_dtype
        self.kv_block_shape = None if kv_block_shape is None else tuple(kv_block_shape)
        self.prefix_only = prefix_only

    def check_compatible(self, remote: RemoteKV) -> None:
        """Raise ``IncompatibleKV`` if the remote KV cannot be used by this cache."""
        pairs = [
            ("block_size", remote.block_size, self.block_size),
            ("model_id", remote.model_id, self.model_id),
            ("kv_dtype", remote.kv_dtype, self.kv_dtype),
            ("kv_block_shape", remote.kv_block_shape, self.kv_block_shape),
        ]
        for name, theirs, ours in pairs:
            # A field either side left unset is not checked.
            if theirs is not None and ours is not None and theirs != ours:
                raise IncompatibleKV(f"remote {name}={theirs!r} but local {name}={ours!r}")

    def plan_load(self, remote: RemoteKV, local_hits: LocalHits) -> LoadPlan:
        """The blocks of ``remote`` to pull: all but those held locally by hash.

        ``local_hits`` is a set of hashes or a predicate ``hash -> bool``.
        """
        self.check_compatible(remote)
        held = local_hits if callable(local_hits) else local_hits.__contains__
        hits: list[int] = []
        for i, h in enumerate(remote.block_hashes):
            if held(h):
                hits.append(i)
            elif self.prefix_only:
                break
        hit_set = set(hits)
        loads = tuple(i for i in range(len(remote.block_ids)) if i not in hit_set)
        return LoadPlan(remote, loads, tuple(hits))


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"kv_transfer_params: {message}")


def _get(params: Mapping[str, Any], key: str, kind: type, required: bool = True) -> Any:
    value = params.get(key)
    if value is None and not required:
        return None
    # bool is an int subclass; a port of True is a bug, not a port.
    if not isinstance(value, kind) or isinstance(value, bool):
        expected = kind.__name__
        raise ValueError(f"kv_transfer_params: {key} must be {expected}, got {value!r}")
    return value


def _int_list(params: Mapping[str, Any], key: str) -> list[int]:
    value = params.get(key)
    if not isinstance(value, list | tuple) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise ValueError(f"kv_transfer_params: {key} must be a list of ints, got {value!r}")
    return list(value)


def _hashes(params: Mapping[str, Any]) -> list[BlockHash]:
    value = params.get("block_hashes")
    if not isinstance(value, list | tuple):
        raise ValueError(f"kv_transfer_params: block_hashes must be a list, got {value!r}")
    try:
        return [bytes.fromhex(h) for h in value]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"kv_transfer_params: block_hashes must be hex strings ({exc})") from exc
