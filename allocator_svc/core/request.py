"""Per-request allocator state and the records a step returns."""

from __future__ import annotations

from dataclasses import dataclass, field

from allocator_svc.core.free_queue import Block


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    lease_id: str | None
    root_hash: bytes  # chain root: binds the model fingerprint and the cache salt
    token_ids: list[int]  # the known tokens: the prompt, then the outputs appended so far
    num_prompt_tokens: int
    # Tokens granted slots (their KV is written by the granting step). At most one past the
    # known tokens: a decode's token may be granted while its value is being sampled.
    num_computed: int = 0
    num_committed: int = 0  # tokens whose KV the gateway confirmed written (hashed: known ones)
    blocks: list[Block] = field(default_factory=list)  # the block table (GPU)
    block_hashes: list[bytes] = field(default_factory=list)  # hashes of leading full blocks
    cpu_block_ids: list[int] | None = None  # the table while swapped out
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    # (a hand-off's reservation: its leading tokens the pool had cached, hand_off.py)
    num_cpu_cached_tokens: int = 0  # of which copied back from the CPU tier
    num_preemptions: int = 0  # swap preemptions survived (recompute ones end the request)
    tenant: str = ""  # whose block quota its blocks count against ("": none)
    priority: int = 0  # its level: lower values more urgent (victims.py, by cost)
    # Of num_computed, the tokens its tenant's service counts already (tenant_service.py):
    # cached and forked ones are never charged, nor a moved request's.
    num_charged: int = 0
    # Slots past num_computed granted for draft tokens (speculative decoding) and not yet
    # settled: the table covers num_computed + num_lookahead tokens until the accept.
    num_lookahead: int = 0

    @property
    def swapped(self) -> bool:
        return self.cpu_block_ids is not None


@dataclass(slots=True)
class Grant:
    """What a scheduled request must tell its executor: table delta and token span."""

    request_id: str
    delta_start: int  # replace the table from this index on ...
    block_ids: list[int]  # ... with these blocks
    num_scheduled: int
    start_position: int
    num_cached_tokens: int = 0
    new_request: bool = False
    num_cpu_cached_tokens: int = 0  # of num_cached_tokens, copied back from the CPU tier
    num_lookahead: int = 0  # slots for drafts past the scheduled ones (Pool.add_lookahead)

    @property
    def changes_table(self) -> bool:
        return bool(self.block_ids)


