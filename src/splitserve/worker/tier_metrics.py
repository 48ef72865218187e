"""Prometheus metrics of the KV tier ladder, per tier (``device``, ``host``, ``disk``).

Counters live in plain stats objects on the engine (``Tiering``, ``TieredStore``, the disk
tier); a collector reads them at scrape time, so the engine never calls prometheus-client.

* ``splitserve:kv_tier_blocks``/``_bytes``/``_capacity_bytes`` — what each tier holds.
* ``splitserve:kv_tier_hits``/``_misses`` — block lookups per tier; a lookup that passes a
  tier (found lower, or nowhere) is that tier's miss.
* ``splitserve:kv_tier_promotions{to}`` — blocks copied up into ``device`` or ``host``.
* ``splitserve:kv_tier_demotions{from}`` — blocks whose KV left ``device`` or ``host`` for
  the tier below.
* ``splitserve:kv_tier_load_seconds{tier}`` — one load into the device pool, by the slowest
  tier it read; ``splitserve:kv_tier_loaded_blocks{tier}`` — the blocks those loads moved.
* ``splitserve:kv_tier_checksum_failures``, ``splitserve:kv_tier_read_failures{reason}`` (disk),
  ``splitserve:kv_tier_host_decrypt_failures`` (a sealed host tier).
* ``splitserve:kv_tier_pinned_blocks``, ``splitserve:kv_tier_pins{event}``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

_LOAD_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


class TierCollector:
    """Reads ``engine``'s tier stats at scrape time (an ``LLMEngine`` with ``tiering``)."""

    def __init__(self, engine: Any, registry: CollectorRegistry) -> None:
        self.engine = engine
        self.load_seconds = Histogram(
            "splitserve:kv_tier_load_seconds",
            "Duration of one load of blocks into the device pool, by the slowest tier read",
            ["tier"],
            buckets=_LOAD_BUCKETS,
            registry=registry,
        )
        self.loaded_blocks = Counter(
            "splitserve:kv_tier_loaded_blocks",
            "Blocks loaded into the device pool, by the slowest tier of their load",
            ["tier"],
            registry=registry,
        )
        if engine.kv_tiers is not None:
            engine.kv_tiers.mover.on_load = self.observe_load
        registry.register(self)

    def observe_load(self, tier: str, seconds: float, blocks: int) -> None:
        self.load_seconds.labels(tier).observe(seconds)
        self.loaded_blocks.labels(tier).inc(blocks)

    def describe(self) -> list[Metric]:
        return []  # families are built at scrape time; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        rows = self._rows()
        yield _gauge("kv_tier_blocks", "KV blocks held, per tier", rows, "blocks")
        yield _gauge("kv_tier_bytes", "KV bytes held, per tier", rows, "bytes")
        yield _gauge("kv_tier_capacity_bytes", "Size bound, per tier", rows, "capacity")
        yield _counter("kv_tier_hits", "Block lookups served, per tier", rows, "hits")
        yield _counter("kv_tier_misses", "Block lookups that passed a tier", rows, "misses")
        yield from self._traffic()
        yield from self._pins()

    def _rows(self) -> list[dict[str, Any]]:
        bm, runner = self.engine.block_manager, self.engine.runner
        cached = bm.num_cached_blocks
        rows = [
            dict(
                tier="device",
                blocks=cached,
                bytes=cached * runner.bytes_per_block,
                capacity=bm.num_blocks * runner.bytes_per_block,
                hits=bm.prefix_hits,
                misses=bm.prefix_queries - bm.prefix_hits,
            )
        ]
        tiers = self.engine.kv_tiers
        if tiers is None:
            return rows
        stats, usages = tiers.ladder.store.stats, tiers.ladder.store.usage()
        for i, (name, usage) in enumerate(zip(tiers.ladder.names, usages, strict=True)):
            passed = sum(stats.hits[i + 1 :]) + stats.misses
            rows.append(
                dict(
                    tier=name,
                    blocks=usage.blocks,
                    bytes=usage.bytes_used,
                    capacity=usage.bytes_capacity,
                    hits=stats.hits[i] + (stats.pending_hits if i == 0 else 0),
                    misses=passed,
                )
            )
        return rows

    def _traffic(self) -> Iterator[Metric]:
        t = self.engine.tiering.stats
        tiers = self.engine.kv_tiers
        store = tiers.ladder.store.stats if tiers is not None else None
        up = CounterMetricFamily(
            "splitserve:kv_tier_promotions", "Blocks copied up into a tier", labels=["to"]
        )
        up.add_metric(["device"], t.blocks_loaded)
        down = CounterMetricFamily(
            "splitserve:kv_tier_demotions", "Blocks whose KV left a tier for the one below",
            labels=["from"],
        )  # fmt: skip
        down.add_metric(["device"], t.device_demotions)
        if store is not None and "host" in tiers.ladder.names and len(tiers.ladder.names) > 1:
            up.add_metric(["host"], store.promotions)
            down.add_metric(["host"], store.demotions)
        yield up
        yield down
        saved = CounterMetricFamily(
            "splitserve:kv_tier_saved_blocks", "Completed blocks copied below the device pool"
        )
        saved.add_metric([], t.blocks_saved)
        yield saved
        yield from self._disk_failures()

    def _disk_failures(self) -> Iterator[Metric]:
        disk = self.engine.kv_tiers.ladder.disk() if self.engine.kv_tiers is not None else None
        checksum = CounterMetricFamily(
            "splitserve:kv_tier_checksum_failures", "Disk blocks that failed their checksum"
        )
        reasons = CounterMetricFamily(
            "splitserve:kv_tier_read_failures",
            "Disk blocks treated as a miss, by reason",
            labels=["reason"],
        )
        if disk is not None:
            s = disk.stats
            checksum.add_metric([], s.checksum_failures)
            for reason in ("checksum", "header", "decrypt"):
                reasons.add_metric([reason], getattr(s, f"{reason}_failures"))
            reasons.add_metric(["io"], s.io_errors)
        yield checksum
        yield reasons
        host = self.engine.kv_tiers.ladder.host() if self.engine.kv_tiers is not None else None
        sealed = CounterMetricFamily(
            "splitserve:kv_tier_host_decrypt_failures",
            "Sealed host-RAM blocks that did not open (a key gone, tampering), treated as a miss",
        )
        if host is not None:
            sealed.add_metric([], host.decrypt_failures)
        yield sealed

    def _pins(self) -> Iterator[Metric]:
        tiering = self.engine.tiering
        gauge = GaugeMetricFamily(
            "splitserve:kv_tier_pinned_blocks", "Device blocks pinned by retention"
        )
        gauge.add_metric([], tiering.pinned_blocks)
        yield gauge
        pins = CounterMetricFamily(
            "splitserve:kv_tier_pins", "Retention pins, by event", labels=["event"]
        )
        pins.add_metric(["pinned"], tiering.stats.pins)
        pins.add_metric(["expired"], tiering.stats.pins_expired)
        yield pins


def _gauge(name: str, doc: str, rows: list[dict[str, Any]], key: str) -> Metric:
    family = GaugeMetricFamily(f"splitserve:{name}", doc, labels=["tier"])
    for row in rows:
        family.add_metric([row["tier"]], row[key])
    return family


def _counter(name: str, doc: str, rows: list[dict[str, Any]], key: str) -> Metric:
    family = CounterMetricFamily(f"splitserve:{name}", doc, labels=["tier"])
    for row in rows:
        family.add_metric([row["tier"]], row[key])
    return family
