"""KV hand-off between executors, as plain Python: the layout both sides must share, the
checks of an ExportKV / ImportKV call, and each block's checksum. No generated code, no torch.

A block on the wire is one KVBlock message: every layer's key then value of one block, in
the layout's `format` (the real executor's: `kv[:, :, block_id]` made contiguous, raw bytes),
with the CRC-32 (zlib) of those bytes.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc

from common.errors import FailedPrecondition, InvalidArgument, ServiceError
from common.kv_layout import KVLayout

TORCH_FORMAT = "torch-kv-v1"  # kv[:, :, block_id]: [layers, 2 (key, value), block_size, Hkv, D]
SIMULATED_FORMAT = "simulated-slot-digest-v1"  # one little-endian uint64 digest per slot


class KVBlockStore(Protocol):
    """A runner's KV blocks as bytes. `read` is called from the transfer thread while steps
    run in the compute thread (it reads a parked request's blocks, which no step writes);
    `write` from the compute thread, between steps, in Execute order."""

    def read(self, block_ids: Sequence[int]) -> list[bytes]: ...

    def write(self, block_ids: Sequence[int], data: Sequence[bytes]) -> None: ...

    def transfer_s(self, num_blocks: int) -> float:
        """Extra seconds moving `num_blocks` takes beyond the real transfer: 0 for a real
        cache, the modelled network time for the simulated executor."""
        ...


def crc32(data: bytes) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def first_difference(ours: KVLayout, theirs: KVLayout) -> str | None:
    """`field: ours X, theirs Y` for the first field that differs; None when equal."""
    for f in dataclasses.fields(KVLayout):
        mine, other = getattr(ours, f.name), getattr(theirs, f.name)
        if mine != other:
            return f"{f.name}: ours {mine!r}, the caller's {other!r}"
    return None


def blocks_covering(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(frozen=True, slots=True)
class ExportRange:
    """What an ExportKV call asks of one held request."""

    request_id: str
    first_block_index: int
    num_blocks: int
    num_tokens: int


def export_block_ids(wanted: ExportRange, table: Sequence[int], num_computed: int,
                     ours: KVLayout, theirs: KVLayout) -> list[int]:
    """The block ids to stream, in table order; raises the contract's errors."""
    rid = wanted.request_id
    difference = first_difference(ours, theirs)
    if difference is not None:
        raise FailedPrecondition(
            f"KV layouts differ, {difference}: hand requests off only between executors of "
            "the same model, block size, dtype and format (see Describe's kv_layout)"
        )
    if wanted.num_tokens > num_computed:
        raise FailedPrecondition(
            f"request {rid!r}: {wanted.num_tokens} tokens asked for, but only "
            f"{num_computed} have KV here; export after the step that computes them"
        )
    covering = blocks_covering(wanted.num_tokens, ours.block_size)
    end = wanted.first_block_index + wanted.num_blocks
    if end > covering:
        raise InvalidArgument(
            f"request {rid!r}: table indices [{wanted.first_block_index}, {end}) reach past the "
            f"{covering} blocks that hold its first {wanted.num_tokens} tokens"
        )
    assert covering <= len(table), f"request {rid!r}: its table does not cover its tokens"
    return list(table[wanted.first_block_index:end])


@dataclass(frozen=True, slots=True)
class ImportPlan:
    """A checked ImportKV call: pull table indices [first_block_index, ...) into block_ids."""

    source_address: str
    request_id: str
    first_block_index: int
    block_ids: tuple[int, ...]
    num_tokens: int


def check_import(plan: ImportPlan, block_size: int, num_blocks: int) -> None:
    """The target's own checks of an ImportKV call, before it calls the source."""
    rid = plan.request_id
    if not rid:
        raise InvalidArgument("request_id is empty; name the request the source holds")
    if not plan.source_address:
        raise InvalidArgument("source_address is empty; give the host:port of the executor "
                              "that holds the request")
    if plan.num_tokens == 0:
        raise InvalidArgument(f"request {rid!r}: num_tokens is 0; give its computed tokens")
    expected = blocks_covering(plan.num_tokens, block_size) - plan.first_block_index
    if len(plan.block_ids) != expected:
        raise InvalidArgument(
            f"request {rid!r}: {len(plan.block_ids)} block_ids for {plan.num_tokens} tokens "
            f"from table index {plan.first_block_index}; send exactly "
            f"ceil({plan.num_tokens} / {block_size}) - {plan.first_block_index} = "
            f"{max(expected, 0)}" + ("" if expected >= 0 else " (first_block_index is past "
                                     "the blocks of num_tokens)")
        )
    bad = [b for b in plan.block_ids if not 0 <= b < num_blocks]
    if bad:
        raise InvalidArgument(
            f"request {rid!r}: block id {bad[0]} is outside [0, {num_blocks}) (see Describe)"
        )
    seen: set[int] = set()
    for block_id in plan.block_ids:
        if block_id in seen:
            raise InvalidArgument(f"request {rid!r}: block id {block_id} appears twice in "
                                  "block_ids; give each table index its own block")
        seen.add(block_id)


class DataLoss(ServiceError):
    code = grpc.StatusCode.DATA_LOSS


@dataclass(slots=True)
class BlockReceiver:
    """Checks the source's stream as it arrives: indices in table order, none missing or
    extra, each block's length and CRC."""

    source: str  # "source <address>", for messages
    first_block_index: int
    num_blocks: int
    bytes_per_block: int
    received: int = 0

    def check(self, block_index: int, data: bytes, crc: int) -> None:
        expected = self.first_block_index + self.received
        if self.received == self.num_blocks:
            raise DataLoss(f"{self.source}: sent block index {block_index} after the "
                           f"{self.num_blocks} blocks asked for")
        if block_index != expected:
            raise DataLoss(f"{self.source}: sent block index {block_index} where "
                           f"{expected} was due (blocks go in table order)")
        if len(data) != self.bytes_per_block:
            raise DataLoss(f"{self.source}: block index {block_index} has {len(data)} bytes, "
                           f"not the layout's {self.bytes_per_block}")
        if crc32(data) != crc:
            raise DataLoss(f"{self.source}: block index {block_index} fails its checksum "
                           f"(crc32 {crc32(data):#010x}, sent {crc:#010x})")
        self.received += 1

    def finish(self) -> None:
        if self.received != self.num_blocks:
            raise DataLoss(f"{self.source}: the stream ended after {self.received} of "
                           f"{self.num_blocks} blocks")
