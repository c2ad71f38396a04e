"""What an executor says of itself (Describe), declared once: the executors report it and the
gateway reads it, through the one codec below (the executor proto's DescribeResponse)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from common.kv_layout import KVLayout
from pagedkv.executor.v1 import executor_pb2 as pb

MAX_POOL_NAME_CHARS = 256  # a pool's name at the allocator and in every log line


@dataclass(frozen=True, slots=True)
class ExecutorDescription:
    instance_id: str  # a new one per process: a new instance means a reset pool
    model_name: str
    model_fingerprint: str
    num_blocks: int
    block_size: int
    num_cpu_blocks: int
    backend: str
    device: str
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    dtype: str = ""  # "": not reported
    # It fills in its own sampled tokens (use_sampled_token): the next Execute may go out
    # before the previous one returns.
    uses_sampled_tokens: bool = False
    pool_name: str = ""  # its stable pool name ("": name the pool by the address)
    num_cpu_cache_blocks: int = 0  # of num_cpu_blocks, the prefix cache's CPU tier
    role: str = "both"  # "prefill", "decode" or "both" (an executor that says none: both)
    kv_layout: KVLayout | None = None  # None: it reports none (moves no KV)
    structured_output: bool = False  # it applies SamplingParams.structured_output
    max_draft_tokens: int = 0  # SequenceWork.num_draft_tokens it verifies at most (0: none)

    def to_proto(self) -> pb.DescribeResponse:
        msg = pb.DescribeResponse(**{
            f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if f.name != "kv_layout"})
        if self.kv_layout is not None:
            msg.kv_layout.CopyFrom(layout_to_proto(self.kv_layout))
        return msg

    @classmethod
    def from_proto(cls, msg: pb.DescribeResponse) -> ExecutorDescription:
        """As the gateway reads any executor's answer: a long pool name cut, no role: both."""
        values = {f.name: getattr(msg, f.name) for f in dataclasses.fields(cls)
                  if f.name != "kv_layout"}
        values["eos_token_ids"] = tuple(msg.eos_token_ids)
        values["pool_name"] = msg.pool_name[:MAX_POOL_NAME_CHARS]
        values["role"] = msg.role or "both"
        layout = layout_from_proto(msg.kv_layout) if msg.HasField("kv_layout") else None
        return cls(**values, kv_layout=layout)


def layout_to_proto(layout: KVLayout) -> pb.KVLayout:
    return pb.KVLayout(**dataclasses.asdict(layout))


def layout_from_proto(msg: pb.KVLayout) -> KVLayout:
    return KVLayout(**{f.name: getattr(msg, f.name) for f in dataclasses.fields(KVLayout)})
