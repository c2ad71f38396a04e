"""The workload a recording carried, as plain values (trace.py reads them), and the checks
its fields go through."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from allocator_svc.recording import HASH_PREFIX_BYTES
from tools.replay.step_time import StepTime

Fail = Callable[[str], Exception]


class RecordingError(Exception):
    """A recording that cannot be replayed: the message names the file, the line and what is
    wrong with it."""


@dataclass(frozen=True, slots=True)
class PoolShape:
    pool_id: str
    num_blocks: int
    block_size: int
    num_cpu_blocks: int
    prefix_caching: bool
    num_cpu_cache_blocks: int = 0  # of num_cpu_blocks, the prefix cache's CPU tier


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    """One request (or, with `children`, an n > 1 request's shared prompt, forked into them)."""

    request_id: str
    arrival_s: float
    num_prompt_tokens: int  # at its first admission (forked: the parent's token count)
    num_tokens: int  # when it ended: prompt and appended tokens, what its KV covered
    block_hashes: bytes  # its full blocks' chain hashes at the recorded block size, prefixes
    token_ids: tuple[int, ...] | None  # recorded with --record-token-ids
    aborted: bool  # cancelled (not committed) rather than freed
    children: tuple[RecordedRequest, ...] = ()

    @property
    def num_hashed_blocks(self) -> int:
        return len(self.block_hashes) // HASH_PREFIX_BYTES

    def block_hash(self, index: int) -> bytes:
        return self.block_hashes[index * HASH_PREFIX_BYTES : (index + 1) * HASH_PREFIX_BYTES]

    @property
    def num_sequences(self) -> int:
        return 1 + len(self.children)


@dataclass(frozen=True, slots=True)
class RecordedRun:
    """What the recorded pool itself did."""

    num_steps: int
    peak_used_blocks: int
    sum_used_blocks: int  # over its steps (mean: / num_steps)
    num_prefix_queries: int  # prompt tokens of first admissions
    num_prefix_hits: int  # of which cached
    num_preemptions: int
    num_swaps: int
    duration_s: float


@dataclass(frozen=True, slots=True)
class PoolTrace:
    shape: PoolShape
    requests: tuple[RecordedRequest, ...]  # in arrival order
    recorded: RecordedRun
    step_time: StepTime  # a replayed step's duration, fitted to the recorded Steps' gaps
    swap: bool  # the recorded Steps asked for swap preemption
    num_unfinished: int  # requests whose end the recording never saw: left out
    start_s: float  # its first record's time

    @property
    def num_sequences(self) -> int:
        return sum(r.num_sequences for r in self.requests)


@dataclass(frozen=True, slots=True)
class Recording:
    path: str
    token_ids: bool  # every segment recorded token ids
    pools: dict[str, PoolTrace]
    warnings: tuple[str, ...]


def need(record: dict[str, Any], key: str, kind: type | tuple[type, ...], fail: Fail) -> Any:
    """record[key], which must be of `kind` (a bool is not an int here)."""
    value = record.get(key)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise fail(f"{record.get('k', 'header')} record: {key} must be "
                   f"{getattr(kind, '__name__', 'a number')}, got {value!r:.60}")
    return value


def check_pool(record: dict[str, Any], fail: Fail) -> PoolShape:
    for key, low in (("num_blocks", 1), ("block_size", 1), ("num_cpu_blocks", 0)):
        value = need(record, key, int, fail)
        if value < low:
            what = "a positive integer" if low else "an integer >= 0"
            raise fail(f"pool record: {key} must be {what}, got {value}")
    tier = record.get("num_cpu_cache_blocks", 0)
    if not isinstance(tier, int) or isinstance(tier, bool) or not 0 <= tier <= record[
            "num_cpu_blocks"]:
        raise fail(f"pool record: num_cpu_cache_blocks must be an integer in [0, "
                   f"num_cpu_blocks={record['num_cpu_blocks']}], got {tier!r:.60}")
    return PoolShape(need(record, "pool", str, fail), record["num_blocks"],
                     record["block_size"], record["num_cpu_blocks"],
                     need(record, "prefix_caching", bool, fail), tier)


def check_end(entry: Any, token_ids: bool, block_size: int, fail: Fail) -> list[Any]:
    """[id, "f" | "a" | "l", num_tokens, hashes hex(, token ids)], checked."""
    size = 5 if token_ids else 4
    if (not isinstance(entry, list) or len(entry) not in (4, 5) or not isinstance(entry[0], str)
            or entry[1] not in ("f", "a", "l") or not isinstance(entry[2], int)
            or entry[2] < 0 or not isinstance(entry[3], str)):
        raise fail(f"an end entry must be [id, 'f'|'a'|'l', token count, hashes], got "
                   f"{entry!r:.120}")
    if len(entry) < size:
        raise fail(f"end entry of {entry[0]!r} has no token ids, but the header says it would")
    hashes = entry[3]
    width = 2 * HASH_PREFIX_BYTES
    try:
        bytes.fromhex(hashes)
    except ValueError:
        raise fail(f"end entry of {entry[0]!r}: hashes are not hex") from None
    if len(hashes) % width or len(hashes) // width > entry[2] // block_size:
        raise fail(f"end entry of {entry[0]!r}: {len(hashes) / width:g} hashes for "
                   f"{entry[2]} tokens at block size {block_size}")
    if token_ids:
        tokens = entry[4]
        if (not isinstance(tokens, list) or len(tokens) != entry[2]
                or not all(isinstance(t, int) and t >= -1 for t in tokens)):
            raise fail(f"end entry of {entry[0]!r}: token ids must be {entry[2]} integers")
    return entry[:size]
