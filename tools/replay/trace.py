"""A recording read back as the workload it carried: per pool, its shape, its requests in
arrival order, and what the recorded pool did with them (the format: allocator_svc/recording.py).

A request's arrival is the first Step that named it (admitted, or deferred the first time);
its prompt, the token count at that first admission; its length, the token count when it was
freed (prompt and appended tokens: what its KV covered); its prefix, the chain hashes of its
full blocks then. A request handed off into the pool from another (ReserveHandOff) arrives at
its reservation, every token it brought its prompt. Readmissions after a preemption, a pool
reset or an allocator restart (a new segment) continue the same request. A request whose end
the recording never saw (cut by a crash, a lease expired, preempted and never readmitted) is
left out, and counted.

Errors: a recording that cannot be read raises RecordingError naming the line and what is
wrong, and nothing is replayed (a line cut short by a crash: lines.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from allocator_svc.recording import FORMAT, HASH_PREFIX_BYTES, VERSION
from tools.replay import step_time
from tools.replay.lines import NOT_A_RECORDING, is_header, read_lines
from tools.replay.records import (
    PoolShape,
    PoolTrace,
    RecordedRequest,
    RecordedRun,
    Recording,
    RecordingError,
    check_end,
    check_pool,
    need,
)

BUSY_GAP_S = 1.0  # Steps further apart than this: the pool was idle in between
DEFAULT_STEP_S = 0.02


@dataclass(slots=True, eq=False)
class _Node:
    """One request while reading: its end may come much later, or never."""

    request_id: str
    arrival_s: float
    num_prompt_tokens: int
    end: list[Any] | None = None  # its end entry ("l": live at a stop; may be continued)
    children: list[_Node] = field(default_factory=list)
    fork_num_tokens: int = 0  # forked: the parent's token count then


@dataclass(slots=True)
class _Pool:
    """One recorded pool while reading: its requests, and what the pool itself did."""

    shape: PoolShape
    nodes: list[_Node] = field(default_factory=list)  # top level, in arrival order
    live: dict[str, _Node] = field(default_factory=dict)
    first_wait: dict[str, float] = field(default_factory=dict)
    num_steps: int = 0
    peak_used: int = 0
    sum_used: int = 0
    num_queries: int = 0
    num_hits: int = 0
    num_preemptions: int = 0
    num_swaps: int = 0
    num_hand_offs: int = 0  # requests handed off into it (replayed as prompts)
    swap: bool = False
    last_step: tuple[float, int, int] | None = None  # the last busy step: t, rows, tokens
    gaps: list[tuple[int, int, float]] = field(default_factory=list)  # rows, tokens, gap
    first_t: float | None = None
    last_t: float = 0.0


def read_recording(path: str) -> Recording:
    reader = _Reader(path)
    reader.read()
    return reader.recording()


class _Reader:
    def __init__(self, path: str) -> None:
        self.path = path
        self.pools: dict[str, _Pool] = {}
        self.warnings: list[str] = []
        self.token_ids = False  # every segment's header says it records token ids
        self.segment_token_ids = False
        self.offset = 0.0  # this segment's start on the first's clock
        self.created = 0.0  # the first segment's wall-clock start
        self.last_t = 0.0
        self.line = 0

    def fail(self, message: str) -> RecordingError:
        return RecordingError(f"{self.path}, line {self.line}: {message}")

    def read(self) -> None:
        for line, record in read_lines(self.path, self.warnings):
            self.line = line
            if line == 1 or is_header(record):
                self.header(record)
            else:
                self.record(record)

    def header(self, record: dict[str, Any]) -> None:
        if record.get("format") != FORMAT:
            raise self.fail(NOT_A_RECORDING)
        version = record.get("version")
        if version != VERSION:
            raise self.fail(f"recording format version {version!r}: this replay reads "
                            f"version {VERSION} (replay it with the pagedkv that wrote it)")
        if record.get("hash_prefix_bytes") != HASH_PREFIX_BYTES:
            raise self.fail(f"hash_prefix_bytes must be {HASH_PREFIX_BYTES}, got "
                            f"{record.get('hash_prefix_bytes')!r}")
        created = need(record, "created_unix", (int, float), self.fail)
        token_ids = self.segment_token_ids = need(record, "token_ids", bool, self.fail)
        if self.line == 1:
            self.created, self.token_ids = created, token_ids
        else:  # a restarted allocator: its clock starts again
            self.offset = max(self.last_t, created - self.created)
            self.token_ids = self.token_ids and token_ids
            for pool in self.pools.values():
                pool.last_step = None

    def record(self, record: dict[str, Any]) -> None:
        kind = need(record, "k", str, self.fail)
        t = self.offset + need(record, "t", (int, float), self.fail)
        if t < self.last_t - 1e-3:
            raise self.fail(f"t={t - self.offset} goes back in time (the record before: "
                            f"{self.last_t - self.offset})")
        self.last_t = max(self.last_t, t)
        handler = _HANDLERS.get(kind)
        if handler is None:
            raise self.fail(f"unknown record kind {kind!r}")
        handler(self, record, t)

    def pool(self, record: dict[str, Any], t: float) -> _Pool:
        pool_id = need(record, "pool", str, self.fail)
        pool = self.pools.get(pool_id)
        if pool is None:
            raise self.fail(f"a {record['k']} record for pool {pool_id!r}, which no pool "
                            "record before it registered")
        pool.first_t = t if pool.first_t is None else pool.first_t
        pool.last_t = t
        return pool

    def on_pool(self, record: dict[str, Any], t: float) -> None:
        shape = check_pool(record, self.fail)
        existing = self.pools.get(shape.pool_id)
        if existing is None:
            self.pools[shape.pool_id] = _Pool(shape)
        elif existing.shape != shape:
            self.warnings.append(f"line {self.line}: pool {shape.pool_id!r} registered again "
                                 "with another shape; replayed with its first")

    def on_step(self, record: dict[str, Any], t: float) -> None:
        pool = self.pool(record, t)
        used = need(record, "used", int, self.fail)
        rows = need(record, "rows", int, self.fail)
        if used < 0 or rows < 0:
            raise self.fail("rows and used must be >= 0")
        tokens = record.get("tokens", rows)
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            raise self.fail(f"step record: tokens must be an integer >= 0, got {tokens!r:.40}")
        if rows:  # (not a step that only frees: the replay counts the batches it runs)
            last = pool.last_step
            if last is not None and t - last[0] <= BUSY_GAP_S:
                pool.gaps.append((last[1], last[2], t - last[0]))
            pool.num_steps += 1
            pool.peak_used = max(pool.peak_used, used)
            pool.sum_used += used
        pool.last_step = (t, rows, tokens) if rows else None
        pool.swap = pool.swap or bool(record.get("swap"))
        for request_id in self.entries(record, "wait", str):
            pool.first_wait.setdefault(request_id, t)
        for entry in self.entries(record, "admit", list):
            self.admit(pool, entry, t)
        for entry in self.entries(record, "pre", list):
            if len(entry) != 2 or entry[1] not in ("recompute", "swap"):
                raise self.fail(f"a preemption must be [id, 'recompute' or 'swap'], got {entry}")
            pool.num_preemptions += 1
            pool.num_swaps += entry[1] == "swap"
        self.entries(record, "in", str)
        self.ends(pool, record)

    def on_free(self, record: dict[str, Any], t: float) -> None:
        self.ends(self.pool(record, t), record)

    def on_fork(self, record: dict[str, Any], t: float) -> None:
        pool = self.pool(record, t)
        parent_id = need(record, "parent", str, self.fail)
        num_tokens = need(record, "num_tokens", int, self.fail)
        children = self.entries(record, "children", str)
        parent = pool.live.get(parent_id)
        if parent is None:
            self.warnings.append(f"line {self.line}: fork of {parent_id!r}, whose admission "
                                 "is not in the recording: its children are left out")
            return
        parent.fork_num_tokens = num_tokens
        for child_id in children:
            child = _Node(child_id, t, num_tokens)
            parent.children.append(child)
            pool.live[child_id] = child

    def on_handoff(self, record: dict[str, Any], t: float) -> None:
        """A request handed off into the pool from another: replayed as a prompt of every
        token it brought (the replay has no other pool to move KV from)."""
        pool = self.pool(record, t)
        request_id = need(record, "id", str, self.fail)
        num_tokens = need(record, "num_tokens", int, self.fail)
        if num_tokens < 1:
            raise self.fail(f"handoff record: num_tokens must be >= 1, got {num_tokens}")
        for key in ("prompt", "cached"):
            if not 0 <= need(record, key, int, self.fail) <= num_tokens:
                raise self.fail(f"handoff record: {key} must be in [0, num_tokens="
                                f"{num_tokens}], got {record[key]}")
        pool.num_hand_offs += 1
        node = _Node(request_id, t, num_tokens)
        pool.live[request_id] = node
        pool.nodes.append(node)

    def on_swap_out(self, record: dict[str, Any], t: float) -> None:
        pool = self.pool(record, t)
        need(record, "id", str, self.fail)
        pool.num_preemptions += 1
        pool.num_swaps += 1

    def on_expire(self, record: dict[str, Any], t: float) -> None:
        for request_id in self.entries(record, "ids", str):
            for pool in self.pools.values():
                pool.live.pop(request_id, None)

    def on_stop(self, record: dict[str, Any], t: float) -> None:
        for entry in self.entries(record, "live", list):
            if len(entry) != 2 or not isinstance(entry[0], str) or entry[0] not in self.pools:
                raise self.fail(f"a live entry must be [a recorded pool, end], got {entry!r:.80}")
            pool = self.pools[entry[0]]
            end = check_end(entry[1], self.segment_token_ids, pool.shape.block_size, self.fail)
            node = pool.live.get(end[0])
            if node is not None:
                node.end = end  # provisional: a restarted allocator may see it again

    def admit(self, pool: _Pool, entry: list[Any], t: float) -> None:
        if (len(entry) != 4 or not isinstance(entry[0], str) or entry[3] not in (0, 1)
                or not all(isinstance(n, int) for n in entry[1:3])
                or not 0 <= entry[2] <= entry[1]):
            raise self.fail("an admission must be [id, prompt tokens, cached tokens <= prompt "
                            f"tokens, resumed 0 or 1], got {entry!r:.120}")
        request_id, num_prompt, num_cached, resumed = entry
        arrival = pool.first_wait.pop(request_id, t)
        if resumed and request_id in pool.live:
            return  # readmitted after a preemption: the same request goes on
        if not resumed:
            pool.num_queries += num_prompt
            pool.num_hits += num_cached
        node = _Node(request_id, arrival, num_prompt)
        pool.live[request_id] = node
        pool.nodes.append(node)

    def ends(self, pool: _Pool, record: dict[str, Any]) -> None:
        for entry in self.entries(record, "end", list):
            end = check_end(entry, self.segment_token_ids, pool.shape.block_size, self.fail)
            node = pool.live.pop(end[0], None)
            if node is not None:
                if end[2] < node.num_prompt_tokens:
                    raise self.fail(f"{end[0]!r} ends with {end[2]} tokens, fewer than the "
                                    f"{node.num_prompt_tokens} it was admitted with")
                node.end = end

    def entries(self, record: dict[str, Any], key: str, kind: type) -> list[Any]:
        values = record.get(key, [])
        if not isinstance(values, list) or not all(isinstance(v, kind) for v in values):
            raise self.fail(f"{key} must be a list of {kind.__name__}s")
        return values

    def recording(self) -> Recording:
        traces = {}
        for pool_id, pool in self.pools.items():
            if pool.num_hand_offs:
                self.warnings.append(
                    f"pool {pool_id!r}: {pool.num_hand_offs} request(s) handed off into it "
                    "from another pool are replayed as prompts of the tokens they brought "
                    "(computed here, not moved)")
            requests, unfinished = [], 0
            for node in pool.nodes:
                request = _request(node, pool.shape.block_size)
                if request is None:
                    unfinished += 1
                else:
                    requests.append(request)
                    unfinished += node_count(node) - request.num_sequences
            run = RecordedRun(pool.num_steps, pool.peak_used, pool.sum_used, pool.num_queries,
                              pool.num_hits, pool.num_preemptions, pool.num_swaps,
                              pool.last_t - (pool.first_t or 0.0))
            requests.sort(key=lambda r: r.arrival_s)
            traces[pool_id] = PoolTrace(pool.shape, tuple(requests), run,
                                        step_time.fit(pool.gaps, DEFAULT_STEP_S), pool.swap,
                                        unfinished, pool.first_t or 0.0)
        return Recording(self.path, self.token_ids, traces, tuple(self.warnings))


_HANDLERS = {
    "pool": _Reader.on_pool, "step": _Reader.on_step, "free": _Reader.on_free,
    "fork": _Reader.on_fork, "swap_out": _Reader.on_swap_out, "expire": _Reader.on_expire,
    "stop": _Reader.on_stop, "handoff": _Reader.on_handoff,
}


def node_count(node: _Node) -> int:
    return 1 + sum(node_count(c) for c in node.children) if node.children else 1


def _request(node: _Node, block_size: int) -> RecordedRequest | None:
    """The finished request, its finished children with it; None if it never ended."""
    children = tuple(c for c in (_request(c, block_size) for c in node.children) if c)
    if node.children:
        if not children:
            return None
        # A forked parent ends where its children start (they carry the whole prefix).
        return RecordedRequest(node.request_id, node.arrival_s, node.fork_num_tokens,
                               node.fork_num_tokens, b"", None, False, children)
    if node.end is None:
        return None
    _, how, num_tokens, hashes, *tokens = node.end
    return RecordedRequest(node.request_id, node.arrival_s, node.num_prompt_tokens, num_tokens,
                           bytes.fromhex(hashes), tuple(tokens[0]) if tokens else None,
                           how == "a")
