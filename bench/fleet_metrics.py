"""The fleet benchmark's view of the services: their Prometheus endpoints and the CPU each
kind of process used, read at both ends of the measured window (bench.fleet)."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import psutil

from tools.launch import Service, Stack

Samples = list[tuple[str, dict[str, str], float]]


def scrape(url: str) -> Samples:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url, timeout=30).text
    return [(s.name, s.labels, s.value)
            for family in text_string_to_metric_families(text) for s in family.samples]


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name`'s series whose labels include `labels`."""
    return sum(v for n, lab, v in samples
               if n == name and all(lab.get(k) == x for k, x in labels.items()))


def by_pool(samples: Samples, name: str) -> dict[str, float]:
    return {lab["pool_id"]: v for n, lab, v in samples if n == name}


def quantile_ms(before: list[Samples], after: list[Samples], histogram: str, q: float,
                **labels: str) -> float | None:
    """Quantile q of a histogram between two scrapes (summed over several processes' own):
    the upper bound (ms) of the bucket that holds it; None without observations."""
    name = f"{histogram}_bucket"
    counts: dict[float, float] = {}
    for samples, sign in ((after, 1.0), (before, -1.0)):
        for process in samples:
            for n, lab, v in process:
                if n == name and all(lab.get(k) == x for k, x in labels.items()):
                    le = float(lab["le"])
                    counts[le] = counts.get(le, 0.0) + sign * v
    observed = counts.get(float("inf"), 0.0)
    if not observed:
        return None
    return next(le for le, n in sorted(counts.items()) if n >= q * observed) * 1e3


@dataclass(frozen=True, slots=True)
class Snapshot:
    at: float  # time.perf_counter()
    allocator: Samples
    gateways: list[Samples]
    executor_busy_s: list[float]  # per executor: seconds spent in steps (modelled time)
    cpu_s: dict[str, float]  # process kind (client, gateway, ...; machine: all) -> CPU seconds


def gateways(stack: Stack) -> list[Service]:
    return [s for s in stack.services if s.name.startswith("gateway")]


def metrics_url(port: int) -> str:
    return f"http://127.0.0.1:{port}/metrics"


def take_snapshot(stack: Stack, processes: dict[str, psutil.Process], at: float) -> Snapshot:
    """`processes` by service name (and `client`): their CPU summed by kind, the part of a
    name before its first '-' (executor-3 -> executor)."""
    allocator = scrape(metrics_url(stack.by_name("allocator").http_ports["--metrics-port"]))
    per_gateway = [scrape(metrics_url(g.http_ports["--http-port"])) for g in gateways(stack)]
    busy_s = [total(scrape(metrics_url(e.http_ports["--metrics-port"])),
                    "pagedkv_executor_step_seconds_sum")
              for e in stack.services if e.name.startswith("executor")]
    cpu: dict[str, float] = {}
    for name, process in processes.items():
        kind = name.split("-")[0]
        times = process.cpu_times()
        cpu[kind] = cpu.get(kind, 0.0) + times.user + times.system
    busy = psutil.cpu_times()
    cpu["machine"] = sum(busy) - busy.idle - getattr(busy, "iowait", 0.0)
    return Snapshot(at, allocator, per_gateway, busy_s, cpu)


def cores_used(before: Snapshot, after: Snapshot) -> dict[str, float]:
    window = after.at - before.at
    return {kind: round((after.cpu_s[kind] - before.cpu_s.get(kind, 0.0)) / window, 2)
            for kind in after.cpu_s}


def executors_busy(before: Snapshot, after: Snapshot) -> list[float]:
    """Each executor's share of the window spent stepping: near 1, the (simulated) GPUs are
    the limit; well under it with requests waiting, the control plane or the clients are."""
    window = after.at - before.at
    return [round((b - a) / window, 3)
            for a, b in zip(before.executor_busy_s, after.executor_busy_s, strict=True)]
