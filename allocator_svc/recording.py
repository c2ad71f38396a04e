"""Allocation recording (`--record-allocations PATH`): the workload the allocator's calls
carry, appended to a file that `python -m tools.replay` replays offline against other pool
sizes, block sizes and preemption modes.

Format, version 1: JSON lines (ASCII, one object per line, each ending in a newline). A
header line opens the file, and again each time an allocator appends to it after a restart
(a new segment: the requests of the one before are gone). Every other line is a record: its
kind `k`, and `t`, seconds since its segment's header (monotonic, 0.1 ms). Ids are the wire's
(sequence ids).

    {"format":"pagedkv-allocations","version":1,"created_unix":1767225600.0,
     "hash_profile":"pagedkv-block-hash-v1","hash_prefix_bytes":8,"token_ids":false}
    {"k":"pool","t":0.01,"pool":"pool-0","num_blocks":4096,"block_size":16,"num_cpu_blocks":0,
     "prefix_caching":true,"reset":false}
    {"k":"step","t":0.02,"pool":"pool-0","rows":2,"used":9,"admit":[["gw/r1",130,0,0]]}
    {"k":"step","t":0.04,"pool":"pool-0","rows":2,"used":9}
    {"k":"step","t":0.09,"pool":"pool-0","rows":1,"used":4,"end":[["gw/r0","f",140,"9f3c..."]]}

Records, by kind:

- pool: a pool registered or reset: num_blocks, block_size, num_cpu_blocks, prefix_caching,
  reset; num_cpu_cache_blocks (of num_cpu_blocks, the prefix cache's CPU tier) only when not
  0, so a recording without a tier reads as before.
- step: every Step the core applied: rows (requests scheduled), used (blocks held after it);
  but for a decode-only step, tokens (computed: a decode one, a prefill chunk many); and
  only when non-empty: swap (1: the call's preemption mode), admit ([id, prompt tokens,
  cached tokens (either tier), resumed 0/1]: new requests admitted), wait (new requests
  deferred, the first time only), pre ([id, "recompute" or "swap"]: preempted), in (swapped
  back in), end (freed or aborted by the call).
- free: a Free or Abort call: end.
- fork: a Fork: parent, num_tokens (the parent's), children.
- swap_out: a SwapOut call: id.
- handoff: a ReserveHandOff call (a request whose KV another pool computed joins this one):
  id, num_tokens (handed off: prompt and generated), prompt (of them), cached (tokens this
  pool had cached). Written only when one happens, so a recording without hand-offs reads as
  before.
- expire: leases expired: ids (their requests, freed by the allocator).
- stop: the recording ends: reason (shutdown, max_bytes, error), live (the requests still
  held, each [pool, end]).

An `end` entry is [id, "f" (freed) | "a" (aborted) | "l" (live at the stop), the request's
token count then (prompt and appended tokens: what its KV covered), its full blocks' chain
hashes at the pool's block size, the first `hash_prefix_bytes` of each, hex, concatenated],
plus its token ids with `--record-token-ids`. The hashes are the allocator's own, computed at
commit (a chain hash stands for the whole prefix up to its block, cache salt included), so
recording hashes nothing; a block never committed (an abort) has none. No token ids unless
asked: a recording says how long requests were and which of them shared which prefixes, not
what they said.

Cheap on the hot path: a Step writes one line, formatted directly (no JSON encoder: it costs
ten times as much on a request's hashes), into a buffer; the requests a call frees are read
after it from the same objects (their counts and hashes stay on them); the hashes are sliced
by a memoryview, not a loop. recording_file.py writes the buffer from a thread of its own,
every MiB, every second (`flush_periodically`) and at shutdown. Never in the way of
serving: a failed write, a disk that falls behind, or a bug here stops the recording with one
log line; the call it observed is answered as if nothing was recorded. Bounded: the file stops
growing at `--record-max-bytes` (the stop record, which lists the live requests, may pass it
by its own size).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import structlog

from allocator_svc.core.pool import Pool, PoolConfig
from allocator_svc.core.request import Request
from allocator_svc.core.step import StepResult
from allocator_svc.recording_file import RecordingFile, RecordingOpenError
from common.block_hash import HASH_VERSION
from common.step_records import PreemptionMode, StepCall

__all__ = ["FORMAT", "HASH_PREFIX_BYTES", "VERSION", "Recorder", "RecordingOpenError",
           "RecordingSettings", "flush_periodically"]

FORMAT = "pagedkv-allocations"
VERSION = 1
HASH_PREFIX_BYTES = 8  # NOTE: _hash_prefixes reads the first 8 bytes of each hash as one "Q"
DEFAULT_MAX_BYTES = 256 << 20
FLUSH_INTERVAL_S = 1.0
MAX_WAITING_IDS = 1 << 16  # per pool: deferred ids remembered so each is written once

log = structlog.get_logger(__name__)
_SWAP = PreemptionMode.SWAP


@dataclass(frozen=True, slots=True)
class RecordingSettings:
    path: str
    token_ids: bool = False
    max_bytes: int = DEFAULT_MAX_BYTES


def live_requests(pools: Mapping[str, Pool]) -> Iterator[tuple[str, Request]]:
    for pool_id, pool in pools.items():
        for request in pool.requests.values():
            yield pool_id, request


class Recorder:
    """Formats the records, from the servicer's event loop, after each call the core applied
    (single writer, like the core)."""

    def __init__(self, settings: RecordingSettings, file: RecordingFile,
                 live: Callable[[], Iterable[tuple[str, Request]]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.file = file
        self.active = True
        self.live = live
        self.clock = clock
        self.origin = clock()
        self.waiting: dict[str, set[str]] = {}  # per pool: deferred new requests, written
        self.pool_keys: dict[str, str] = {}  # pool id -> as a JSON string

    @classmethod
    def open(cls, settings: RecordingSettings, pools: Mapping[str, Pool],
             clock: Callable[[], float] = time.monotonic) -> Recorder:
        """Append to the file, starting with a header; RecordingOpenError if it cannot."""
        file = RecordingFile(settings.path, settings.max_bytes)
        recorder = cls(settings, file, lambda: live_requests(pools), clock)
        header = {"format": FORMAT, "version": VERSION, "created_unix": round(time.time(), 3),
                  "hash_profile": HASH_VERSION, "hash_prefix_bytes": HASH_PREFIX_BYTES,
                  "token_ids": settings.token_ids}
        if not file.write(json.dumps(header, separators=(",", ":")) + "\n"):
            recorder.active = False
            file.abandon()
            log.error("allocation_recording_stopped", reason="max_bytes", path=settings.path,
                      num_bytes=file.num_bytes)
            return recorder
        file.flush()
        log.info("allocation_recording_started", path=settings.path,
                 token_ids=settings.token_ids, max_bytes=settings.max_bytes)
        return recorder

    # What the servicer reports, each after the core applied the call.

    def pool_registered(self, config: PoolConfig, reset: bool) -> None:
        self._safely(lambda: (
            f'{{"k":"pool","t":{self._now()},"pool":{self._pool(config.pool_id)},'
            f'"num_blocks":{config.num_blocks},"block_size":{config.block_size},'
            f'"num_cpu_blocks":{config.num_cpu_blocks},'
            f'{_cpu_tier(config)}'
            f'"prefix_caching":{_bool(config.enable_prefix_caching)},'
            f'"reset":{_bool(reset)}}}\n'))

    def before_free(self, pools: Mapping[str, Pool], pool_id: str,
                    request_ids: Iterable[str]) -> list[Request]:
        """Before a call frees them: the requests it names (their final counts and hashes are
        read after it, from the same objects). Unknown ids are left to the core's checks."""
        pool = pools.get(pool_id) if self.active else None
        if pool is None:
            return []
        held = pool.requests
        return [held[i] for i in request_ids if i in held]

    def before_step(self, pools: Mapping[str, Pool], pool_id: str,
                    call: StepCall) -> list[Request]:
        if not (call.free_request_ids or call.abort_request_ids):
            return []  # most steps
        released = (*call.free_request_ids, *call.abort_request_ids)
        return self.before_free(pools, pool_id, released)

    def step(self, pool: Pool, call: StepCall, result: StepResult,
             ending: list[Request]) -> None:
        if not self.active:
            return
        try:
            if (result.grants or result.preempted or result.deferred or result.swapped_in
                    or ending or call.mode is _SWAP):
                self._step(pool, call, result, ending)
                return
            # Most steps: decodes only. One line, formatted inline (this is the hot path).
            rows = len(call.items) + len(call.decode_request_ids)
            pool_id = pool.config.pool_id
            key = self.pool_keys.get(pool_id) or self._pool(pool_id)
            used = pool.config.num_blocks - pool.blocks.num_free
            if not self.file.write(f'{{"k":"step","t":{self.clock() - self.origin:.4f},'
                                   f'"pool":{key},"rows":{rows},"used":{used}}}\n'):
                self._stop("max_bytes")
        except Exception:
            self._stop("error", exc_info=True)

    def ended(self, pool_id: str, requests: list[Request], aborted: bool) -> None:
        if requests:
            how = "a" if aborted else "f"
            self._safely(lambda: (
                f'{{"k":"free","t":{self._now()},"pool":{self._pool(pool_id)},'
                f'"end":[{",".join(self._end(r, how) for r in requests)}]}}\n'))

    def forked(self, pool_id: str, parent: Request, child_ids: list[str]) -> None:
        self._safely(lambda: (
            f'{{"k":"fork","t":{self._now()},"pool":{self._pool(pool_id)},'
            f'"parent":{_quote(parent.request_id)},"num_tokens":{len(parent.token_ids)},'
            f'"children":[{",".join(map(_quote, child_ids))}]}}\n'))

    def handed_off(self, pool_id: str, request: Request) -> None:
        self._safely(lambda: (
            f'{{"k":"handoff","t":{self._now()},"pool":{self._pool(pool_id)},'
            f'"id":{_quote(request.request_id)},"num_tokens":{len(request.token_ids)},'
            f'"prompt":{request.num_prompt_tokens},"cached":{request.num_cached_tokens}}}\n'))

    def swapped_out(self, pool_id: str, request_id: str) -> None:
        self._safely(lambda: (
            f'{{"k":"swap_out","t":{self._now()},"pool":{self._pool(pool_id)},'
            f'"id":{_quote(request_id)}}}\n'))

    def expired(self, request_ids: list[str]) -> None:
        if request_ids:
            self._safely(lambda: (f'{{"k":"expire","t":{self._now()},'
                                  f'"ids":[{",".join(map(_quote, request_ids))}]}}\n'))

    def flush(self) -> None:
        if self.active:
            self.file.flush()
            failure = self.file.failure()
            if failure is not None:
                self._stop(failure)

    def close(self, reason: str = "shutdown") -> None:
        if self.active:
            self._stop(reason)

    def _step(self, pool: Pool, call: StepCall, result: StepResult,
              ending: list[Request]) -> None:
        """A step that admits, defers, preempts, swaps or ends requests: the general line."""
        rows = len(call.items) + len(call.decode_request_ids)
        parts = [f'{{"k":"step","t":{self._now()},"pool":{self._pool(pool.config.pool_id)},'
                 f'"rows":{rows},"used":{pool.config.num_blocks - pool.blocks.num_free},'
                 f'"tokens":{_tokens(call, result, rows)}']
        grants, preempted, deferred = result.grants, result.preempted, result.deferred
        if call.mode is _SWAP:
            parts.append(',"swap":1')
        waiting = self.waiting.setdefault(pool.config.pool_id, set())
        admitted = [g for g in grants if g.new_request]
        if admitted:
            resumed = {i.request_id for i in call.items if i.resumed}
            held = pool.requests
            parts.append(',"admit":[' + ",".join(
                f"[{_quote(g.request_id)},{held[g.request_id].num_prompt_tokens},"
                f"{g.num_cached_tokens},{int(g.request_id in resumed)}]" for g in admitted) + "]")
            waiting.difference_update(g.request_id for g in admitted)
        if deferred:
            new_ids = {i.request_id for i in call.items if i.prompt_token_ids is not None}
            first = [i for i in deferred if i in new_ids and i not in waiting]
            if first:
                if len(waiting) + len(first) > MAX_WAITING_IDS:
                    waiting.clear()  # (some may be written twice: the reader keeps the first)
                waiting.update(first)
                parts.append(',"wait":[' + ",".join(map(_quote, first)) + "]")
        if preempted:
            parts.append(',"pre":[' + ",".join(
                f'[{_quote(p.request_id)},"{p.mode.value}"]' for p in preempted) + "]")
        if result.swapped_in:
            parts.append(',"in":[' + ",".join(map(_quote, result.swapped_in)) + "]")
        if ending:
            aborted = set(call.abort_request_ids)
            parts.append(',"end":[' + ",".join(
                self._end(r, "a" if r.request_id in aborted else "f") for r in ending) + "]")
        parts.append("}\n")
        self._write("".join(parts))

    def _end(self, request: Request, how: str) -> str:
        tokens = request.token_ids  # (its last computed token's value may not be known)
        entry = (f'[{_quote(request.request_id)},"{how}",{max(len(tokens), request.num_computed)},'
                 f'"{_hash_prefixes(request.block_hashes)}"')
        if self.settings.token_ids:
            return f'{entry},[{",".join(map(str, tokens))}]]'
        return entry + "]"

    def _now(self) -> str:
        return f"{self.clock() - self.origin:.4f}"

    def _pool(self, pool_id: str) -> str:
        key = self.pool_keys.get(pool_id)
        if key is None:
            key = self.pool_keys[pool_id] = _quote(pool_id)
        return key

    def _safely(self, line: Callable[[], str]) -> None:
        """Write the line `line()` builds; a bug there stops the recording, not the call."""
        if self.active:
            try:
                self._write(line())
            except Exception:
                self._stop("error", exc_info=True)

    def _write(self, line: str) -> None:
        if not self.file.write(line):
            self._stop("max_bytes")

    def _stop(self, reason: str, exc_info: bool = False) -> None:
        """Write the stop record (past the bound if need be) and close."""
        self.active = False
        last = ""
        if not reason.startswith(("io_error", "backlog")):
            try:
                live = ",".join(f"[{self._pool(pool_id)},{self._end(r, 'l')}]"
                                for pool_id, r in self.live())
                last = (f'{{"k":"stop","t":{self._now()},"reason":{_quote(reason)},'
                        f'"live":[{live}]}}\n')
            except Exception:
                log.exception("allocation_recording_stop_record_failed", path=self.settings.path)
        self.file.close(last, wait=reason == "shutdown")
        if reason == "shutdown":
            log.info("allocation_recording_closed", path=self.settings.path,
                     num_bytes=self.file.num_bytes)
        else:
            log.error("allocation_recording_stopped", reason=reason.split(":")[0],
                      detail=reason, path=self.settings.path, num_bytes=self.file.num_bytes,
                      exc_info=exc_info)


def _tokens(call: StepCall, result: StepResult, rows: int) -> int:
    """The tokens a (non-decode-only) step computes: one a decode, a grant's count, an
    item's own where the fast path took it; none for the deferred and the preempted."""
    skipped = {*result.deferred, *(p.request_id for p in result.preempted)}
    granted = {g.request_id: g.num_scheduled for g in result.grants}
    return rows - len(call.items) + sum(
        granted.get(i.request_id, i.num_tokens) for i in call.items if i.request_id not in skipped)


def _quote(text: str) -> str:
    """`text` as a JSON string. Ids are printable ASCII without quotes or backslashes, but for
    the rare one that is not."""
    if text.isascii() and text.isprintable() and '"' not in text and "\\" not in text:
        return f'"{text}"'
    return json.dumps(text)


def _bool(value: bool) -> str:
    return "true" if value else "false"


def _cpu_tier(config: PoolConfig) -> str:
    tier = config.num_cpu_cache_blocks
    return f'"num_cpu_cache_blocks":{tier},' if tier else ""


def _hash_prefixes(hashes: list[bytes]) -> str:
    """The first HASH_PREFIX_BYTES of each hash, hex, concatenated. A memoryview of the
    joined 32-byte hashes as 8-byte words takes every fourth: no loop in Python."""
    return bytes(memoryview(b"".join(hashes)).cast("Q")[::4]).hex()


async def flush_periodically(recorder: Recorder, interval_s: float = FLUSH_INTERVAL_S) -> None:
    """Hand the buffer to the writer every `interval_s`, until the recording stops (or the
    task is cancelled at shutdown)."""
    while recorder.active:
        await asyncio.sleep(interval_s)
        recorder.flush()
