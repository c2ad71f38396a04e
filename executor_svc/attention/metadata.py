"""Per-step attention metadata: built once per step, shared by every layer.

Token spans in one step's packed row (three sequences; `|` marks block boundaries, S = slots
already in the cache, N = this step's new tokens, whose K/V are written before attention):

    packed row:  [ a0 a1 a2 a3 | b0 | c0 c1 ]        query_start: a=0, b=4, c=5
    seq a (prefill, start 0)   cache: N N N N              context_len 4
    seq b (decode, start 37)   cache: S S ... S N          context_len 38
    seq c (chunk,  start 16)   cache: S*16 | N N           context_len 18
"""

from __future__ import annotations

from dataclasses import dataclass

from executor_svc.attention.step_arrays import DeviceArray, StepArrays


@dataclass(frozen=True, slots=True)
class SeqSpan:
    query_start: int  # index of the sequence's first new token in the packed row
    query_len: int  # new tokens this step
    context_len: int  # tokens in the cache once this step's K/V are written
    block_ids: tuple[int, ...]  # the block table; covers context_len

    @property
    def start_position(self) -> int:
        return self.context_len - self.query_len


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """What a backend plans a step's kernels with, before any layer runs."""

    num_q_heads: int
    scale: float  # the model's softmax scale: every layer's


@dataclass(frozen=True, slots=True)
class StepMetadata:
    spans: tuple[SeqSpan, ...]
    block_size: int
    num_tokens: int
    arrays: StepArrays  # the step's device arrays: backends add theirs while planning
    slot_mapping: DeviceArray  # [num_tokens] long: block_id * block_size + offset per token

    @classmethod
    def build(
        cls, spans: tuple[SeqSpan, ...], block_size: int, arrays: StepArrays
    ) -> StepMetadata:
        slots: list[int] = []
        for span in spans:
            for position in range(span.start_position, span.context_len):
                block_id = span.block_ids[position // block_size]
                slots.append(block_id * block_size + position % block_size)
        return cls(
            spans=spans,
            block_size=block_size,
            num_tokens=len(slots),
            arrays=arrays,
            slot_mapping=arrays.add(slots),
        )
