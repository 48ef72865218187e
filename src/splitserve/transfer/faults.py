"""Test-only fault injection on the serving side of a transfer.

The integration tests reach these through the worker (a ``--kv-test-fault`` option), so a
fault is a plain value parsed from a string such as ``"corrupt_block=3"``,
``"drop_after_bytes=65536"`` or ``"stall_s=2"`` (comma-separated to combine).
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True, slots=True)
class FaultInjection:
    """``corrupt_block``: the N-th block served (0-based, counted over the server's life, so it
    fires once) arrives damaged: tcp flips one byte of it on the wire (a copy, never the
    cache); shm announces a checksum with bits flipped, since its bytes may be the prefill
    worker's live cache (so it needs ``shm_checksums``). ``drop_after_bytes``: close the
    connection once that many block bytes were sent (shm: before announcing any block).
    ``stall_s``: wait this long before answering a pull (to provoke client timeouts)."""

    corrupt_block: int | None = None
    drop_after_bytes: int | None = None
    stall_s: float | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and value < 0:
                raise ValueError(f"fault {f.name} must be >= 0, got {value}")

    @classmethod
    def parse(cls, spec: str | None) -> FaultInjection | None:
        """``"corrupt_block=3,stall_s=0.5"`` -> ``FaultInjection``; empty or None -> None."""
        if not spec:
            return None
        kinds = {"corrupt_block": int, "drop_after_bytes": int, "stall_s": float}
        values: dict[str, int | float] = {}
        for item in spec.split(","):
            key, sep, raw = item.strip().partition("=")
            if not sep or key not in kinds:
                expected = f"key=value with key in {sorted(kinds)}"
                raise ValueError(f"bad fault {item!r}; expected {expected}")
            try:
                values[key] = kinds[key](raw)
            except ValueError as exc:
                raise ValueError(f"bad value in fault {item!r}") from exc
        return cls(**values)
