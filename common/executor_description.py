"""What an executor says of itself (Describe), declared once: the executors report it and the
gateway reads it, through the one codec below (the executor proto's DescribeResponse)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from common.kv_layout import KVLayout
from pagedkv.executor.v1 import executor_pb2 as pb

MAX_POOL_NAME_CHARS = 256  # a pool's name at the allocator and in every log line
_MESSAGES = ("kv_layout", "lora_adapters")  # fields with a codec of their own


@dataclass(frozen=True, slots=True)
class LoraAdapterInfo:
    """A LoRA adapter resident on an executor (the proto's LoraAdapter)."""

    name: str
    digest: str  # sha256 of its config and weights: the block-hash key of its requests
    rank: int
    path: str = ""

    def to_proto(self) -> pb.LoraAdapter:
        return pb.LoraAdapter(name=self.name, digest=self.digest, rank=self.rank, path=self.path)

    @classmethod
    def from_proto(cls, msg: pb.LoraAdapter) -> LoraAdapterInfo:
        return cls(msg.name, msg.digest, msg.rank, msg.path)


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
    max_loras: int = 0  # resident LoRA adapters at most (0: LoRA off)
    max_lora_rank: int = 0
    lora_adapters: tuple[LoraAdapterInfo, ...] = ()  # resident now
    lora_generation: int = 0  # loads and unloads so far: the higher answer is the newer

    def lora_adapter(self, name: str) -> LoraAdapterInfo | None:
        return next((a for a in self.lora_adapters if a.name == name), None)

    def to_proto(self) -> pb.DescribeResponse:
        msg = pb.DescribeResponse(**{
            f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if f.name not in _MESSAGES})
        msg.lora_adapters.extend(a.to_proto() for a in self.lora_adapters)
        if self.kv_layout is not None:
            msg.kv_layout.CopyFrom(layout_to_proto(self.kv_layout))
        return msg

    @classmethod
    def from_proto(cls, msg: pb.DescribeResponse) -> ExecutorDescription:
        """As the gateway reads any executor's answer: a long pool name cut, no role: both."""
        values = {f.name: getattr(msg, f.name) for f in dataclasses.fields(cls)
                  if f.name not in _MESSAGES}
        values["lora_adapters"] = tuple(LoraAdapterInfo.from_proto(a) for a in msg.lora_adapters)
        values["eos_token_ids"] = tuple(msg.eos_token_ids)
        values["pool_name"] = msg.pool_name[:MAX_POOL_NAME_CHARS]
        values["role"] = msg.role or "both"
        layout = layout_from_proto(msg.kv_layout) if msg.HasField("kv_layout") else None
        return cls(**values, kv_layout=layout)


def layout_to_proto(layout: KVLayout) -> pb.KVLayout:
    return pb.KVLayout(**dataclasses.asdict(layout))


def layout_from_proto(msg: pb.KVLayout) -> KVLayout:
    return KVLayout(**{f.name: getattr(msg, f.name) for f in dataclasses.fields(KVLayout)})


def serves(description: ExecutorDescription, lora: LoraAdapterInfo | None) -> bool:
    """The executor can run a request of `lora` (None: the base model): the adapter is loaded
    there with the same contents."""
    return lora is None or any(a.name == lora.name and a.digest == lora.digest
                               for a in description.lora_adapters)
