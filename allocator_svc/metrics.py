"""The allocator's Prometheus metrics, read from its state at scrape time.

Nothing here runs on the hot path: the core keeps its counts as plain ints where the events
happen (block_pool: evictions; pool: copies, swaps, prefix lookups, preemptions) and this
collector reads them when Prometheus scrapes. It runs in the metrics server's thread, beside
the event loop, so it only reads ints and lengths (atomic under the GIL) and copies the pool
table before walking it; it never iterates a request table or the free queue.

A pool replaced by a restarted executor starts its counters from 0: Prometheus's rate()
reads that as a counter reset.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from allocator_svc.core.allocator import Allocator
from allocator_svc.core.pool import Pool

# name -> (help, what to read from a pool); one series per pool, label pool_id.
PoolReadings = dict[str, tuple[str, Callable[[Pool], int]]]
_POOL_GAUGES: PoolReadings = {
    "pagedkv_allocator_blocks": ("KV blocks in the pool", lambda p: p.config.num_blocks),
    "pagedkv_allocator_blocks_used": ("Blocks held by requests or pins (ref_count > 0)",
                                      lambda p: p.config.num_blocks - p.blocks.num_free),
    "pagedkv_allocator_blocks_free": ("Blocks in the free queue, cached ones included",
                                      lambda p: p.blocks.num_free),
    "pagedkv_allocator_blocks_cached": ("Blocks that are prefix-cache entries (held or free)",
                                        lambda p: len(p.blocks.cached)),
    "pagedkv_allocator_cpu_blocks": ("CPU blocks in the pool (swap space and the CPU tier)",
                                     lambda p: p.config.num_cpu_blocks),
    "pagedkv_allocator_cpu_blocks_free": (
        "CPU blocks holding neither a swapped request nor a CPU-tier entry",
        lambda p: p.cpu.num_free),
    "pagedkv_allocator_cpu_cache_blocks": (
        "CPU blocks the prefix cache's CPU tier may hold (0: no tier)",
        lambda p: p.cpu.capacity),
    "pagedkv_allocator_cpu_cache_blocks_cached": (
        "CPU-tier entries: evicted cached blocks kept on the CPU (pending ones too)",
        lambda p: len(p.cpu.entries)),
    "pagedkv_allocator_requests": ("Requests holding blocks of the pool (swapped ones too)",
                                   lambda p: len(p.requests)),
    "pagedkv_allocator_blocks_pinned": ("Cached blocks held for pins: never evicted",
                                        lambda p: p.blocks.num_pinned),
    "pagedkv_allocator_blocks_pinned_pending": (
        "Blocks pins name that are not cached yet (held once a request commits them)",
        lambda p: max(0, len(p.blocks.pinned) - p.blocks.num_pinned)),  # (read mid-unpin)
    "pagedkv_allocator_pins": ("Pinned prefixes (PinPrefix)", lambda p: len(p.pins.pins)),
    "pagedkv_allocator_pin_budget_blocks": ("Most blocks the pool's pins may name",
                                            lambda p: p.pins.budget),
}
_POOL_COUNTERS: PoolReadings = {
    "pagedkv_allocator_evictions": ("Prefix-cache blocks evicted for reuse",
                                    lambda p: p.blocks.num_evictions),
    "pagedkv_allocator_preemptions": ("Requests preempted (recompute or swap)",
                                      lambda p: p.num_preemptions),
    "pagedkv_allocator_cow_copies": ("Copy-on-write block copies planned",
                                     lambda p: p.num_cow_copies),
    "pagedkv_allocator_swap_outs": ("Requests swapped out to CPU blocks",
                                    lambda p: p.num_swap_outs),
    "pagedkv_allocator_swapped_out_blocks": ("Blocks copied to CPU by swap-outs",
                                             lambda p: p.num_swapped_out_blocks),
    "pagedkv_allocator_swap_ins": ("Requests swapped back in", lambda p: p.num_swap_ins),
    "pagedkv_allocator_swapped_in_blocks": ("Blocks copied back from CPU by swap-ins",
                                            lambda p: p.num_swapped_in_blocks),
    "pagedkv_allocator_prefix_cache_queries": ("Prompt tokens looked up in the prefix cache",
                                               lambda p: p.num_prefix_queries),
    "pagedkv_allocator_prefix_cache_hits": ("Prompt tokens served from the prefix cache",
                                            lambda p: p.num_prefix_hits),
    "pagedkv_allocator_cpu_cache_stores": (
        "Cached blocks evicted from the device and copied into the CPU tier",
        lambda p: p.cpu.num_kept),
    "pagedkv_allocator_cpu_cache_loads": (
        "CPU-tier blocks copied back to the device on a prefix hit",
        lambda p: p.cpu.num_loaded),
    "pagedkv_allocator_resumed_prefix_cache_queries": (
        "Prompt tokens looked up by requests readmitted after a recompute preemption",
        lambda p: p.num_resumed_prefix_queries),
    "pagedkv_allocator_resumed_prefix_cache_hits": (
        "Of those, tokens served from the prefix cache",
        lambda p: p.num_resumed_prefix_hits),
    # Hand-offs' lookups, apart from the prompts' (core/hand_off.py).
    "pagedkv_allocator_handoffs": ("Requests reserved for a KV hand-off from another pool",
                                   lambda p: p.num_hand_offs),
    "pagedkv_allocator_handoff_tokens": ("Tokens handed off into the pool",
                                         lambda p: p.num_hand_off_tokens),
    "pagedkv_allocator_handoff_cached_tokens": (
        "Of those, tokens the pool had cached on the device (their KV is not moved)",
        lambda p: p.num_hand_off_cached_tokens),
}


class AllocatorCollector(Collector):
    def __init__(self, allocator: Allocator) -> None:
        self.allocator = allocator

    def collect(self) -> Iterator[Metric]:
        allocator = self.allocator
        pools: list[Pool] = list(allocator.pools.values())  # copied whole: a new pool may come
        for table, family in ((_POOL_GAUGES, GaugeMetricFamily),
                              (_POOL_COUNTERS, CounterMetricFamily)):
            for name, (help_text, read) in table.items():
                metric = family(name, help_text, labels=["pool_id"])
                for pool in pools:
                    metric.add_metric([pool.config.pool_id], read(pool))
                yield metric
        yield _tier_hits(pools)
        yield GaugeMetricFamily("pagedkv_allocator_leases", "Client leases held",
                                value=len(allocator.leases.leases))
        yield CounterMetricFamily("pagedkv_allocator_leases_expired",
                                  "Leases that ran out (their requests were freed)",
                                  value=allocator.num_expired_leases)



def _tier_hits(pools: list[Pool]) -> Metric:
    """Prefix-cache hits (the prompt tokens of pagedkv_allocator_prefix_cache_hits) by the
    tier that served them: the device's blocks, or the CPU tier's copied back."""
    metric = CounterMetricFamily(
        "pagedkv_allocator_prefix_cache_tier_hits",
        "Prompt tokens served from the prefix cache, by tier (device or cpu)",
        labels=["pool_id", "tier"],
    )
    for pool in pools:
        cpu = pool.num_prefix_cpu_hits
        metric.add_metric([pool.config.pool_id, "device"], pool.num_prefix_hits - cpu)
        metric.add_metric([pool.config.pool_id, "cpu"], cpu)
    return metric
