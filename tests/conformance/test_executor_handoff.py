"""KV hand-off: Describe's role and kv_layout, ExportKV's stream and statuses, ImportKV's
checks, and a request moved between two executors that decodes like the reference."""

from __future__ import annotations

import random
import socket
import zlib
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from pagedkv.executor.v1 import executor_pb2 as pb

from .conftest import Executor, Reference, reference_generate

pytestmark = pytest.mark.conformance


def _prompt(vocab_size: int, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab_size) for _ in range(n)]


def _prefill(executor: Executor, rid: str, prompt: list[int]) -> int:
    """Compute `prompt` as a new request; its first sampled token."""
    return int(executor.execute(executor.work(rid, prompt)).tokens[0].token_id)


def _status(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if not isinstance(result, pb.ImportKVResponse):
            list(result)  # type: ignore[call-overload]
    return info.value.code(), info.value.details() or ""


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _blocks_for(executor: Executor, num_tokens: int) -> int:
    return -(-num_tokens // executor.info.block_size)


def test_describe_reports_a_role_and_a_kv_layout(executor: Executor) -> None:
    # The layout agrees with Describe's own fields; the role is one of three.
    info = executor.info
    layout = info.kv_layout
    assert info.role in ("prefill", "decode", "both")
    assert info.HasField("kv_layout") and layout.format and layout.bytes_per_block > 0
    assert (layout.model_fingerprint, layout.block_size, layout.dtype) == (
        info.model_fingerprint, info.block_size, info.dtype)


def test_export_streams_each_block_in_table_order_with_its_crc(executor: Executor) -> None:
    # A 37-token request: table indices 1.. of the blocks holding its tokens, one message
    # each, bytes_per_block long, CRC-32 of the bytes; the whole range from 0 too.
    rid = "handoff-export"
    prompt = _prompt(executor.info.vocab_size, 37, seed=1)
    _prefill(executor, rid, prompt)
    layout, num_blocks = executor.info.kv_layout, _blocks_for(executor, 37)
    try:
        for first in (0, 1):
            blocks = list(executor.export_stub.ExportKV(pb.ExportKVRequest(
                request_id=rid, first_block_index=first, num_blocks=num_blocks - first,
                num_tokens=37, layout=layout), timeout=60))
            assert [b.block_index for b in blocks] == list(range(first, num_blocks))
            for block in blocks:
                assert len(block.data) == layout.bytes_per_block
                assert block.crc32 == zlib.crc32(block.data) & 0xFFFFFFFF
    finally:
        executor.forget(rid)


def test_export_refuses_with_the_contract_statuses(executor: Executor) -> None:
    # Unknown request: NOT_FOUND; more tokens than computed or another layout (the message
    # names the field): FAILED_PRECONDITION; blocks past those of num_tokens: INVALID_ARGUMENT.
    rid = "handoff-export-errors"
    _prefill(executor, rid, _prompt(executor.info.vocab_size, 20, seed=2))
    layout, n = executor.info.kv_layout, _blocks_for(executor, 20)

    def export(**fields: Any) -> Callable[[], object]:
        args: dict[str, Any] = {"request_id": rid, "num_blocks": n, "num_tokens": 20,
                                "layout": layout, **fields}
        request = pb.ExportKVRequest(**args)
        return lambda: executor.export_stub.ExportKV(request, timeout=30)

    other = pb.KVLayout()
    other.CopyFrom(layout)
    other.block_size = layout.block_size * 2
    try:
        assert _status(export(request_id="handoff-nobody"))[0] == grpc.StatusCode.NOT_FOUND
        assert _status(export(num_tokens=21, num_blocks=_blocks_for(executor, 21)))[0] == (
            grpc.StatusCode.FAILED_PRECONDITION)
        code, details = _status(export(layout=other))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "block_size" in details
        assert _status(export(num_blocks=n + 1))[0] == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        executor.forget(rid)


def test_import_refuses_bad_input_and_an_unreachable_source(executor: Executor) -> None:
    # The target's own checks (INVALID_ARGUMENT), then a source nobody listens at
    # (UNAVAILABLE) and one that does not hold the request (NOT_FOUND); the executor keeps
    # serving afterwards.
    n, size = 3, executor.info.block_size
    num_tokens = 2 * size + 1
    ids = executor.blocks.take(n)
    addr = f"127.0.0.1:{_closed_port()}"

    def imp(**fields: Any) -> Callable[[], object]:
        args: dict[str, Any] = {"source_address": addr, "request_id": "handoff-in",
                                "num_tokens": num_tokens, "block_ids": ids, **fields}
        request = pb.ImportKVRequest(**args)
        return lambda: executor.stub.ImportKV(request, timeout=30)

    bad = [imp(request_id=""), imp(num_tokens=0), imp(source_address=""),
           imp(block_ids=ids[:2]), imp(block_ids=[*ids[:2], executor.info.num_blocks]),
           imp(block_ids=[ids[0], ids[1], ids[0]]), imp(first_block_index=n + 1, block_ids=[])]
    try:
        for call in bad:
            assert _status(call)[0] == grpc.StatusCode.INVALID_ARGUMENT
        assert _status(imp())[0] == grpc.StatusCode.UNAVAILABLE
        # An import to be written after an Execute that never reached this executor: the
        # reserved blocks may still be that Execute's, so nothing is imported.
        code, details = _status(imp(previous_step_id=2**62 + 12345))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "previous_step_id" in details
    finally:
        executor.blocks.free.extend(ids)
    tokens = _prompt(executor.info.vocab_size, 5, seed=3)
    _prefill(executor, "handoff-after", tokens)
    executor.forget("handoff-after")


def _adopt(target: Executor, rid: str, table: list[int], prompt: list[int], token: int) -> int:
    """The moved request's first Execute on the target: new (sampling), start_position its
    computed tokens, its whole table, the tokens before it as history."""
    num_tokens = len(prompt)
    table.extend(target.blocks.take(_blocks_for(target, num_tokens + 1) - len(table)))
    target.tables[rid], target.held[rid] = table, num_tokens + 1
    work = pb.SequenceWork(request_id=rid, token_ids=[token], start_position=num_tokens,
                           delta=pb.BlockTableDelta(start_index=0, block_ids=table),
                           sampling=pb.SamplingParams(), history_token_ids=prompt, sample=True)
    return int(target.execute(work).tokens[0].token_id)


def _decode(executor: Executor, rid: str, token: int, steps: int) -> list[int]:
    out = [token]
    for _ in range(steps):
        out.append(int(executor.execute(executor.work(rid, [out[-1]])).tokens[0].token_id))
    return out


@pytest.mark.parametrize("num_tokens", [37, 40])
def test_a_moved_request_decodes_like_the_reference(
    executor: Executor, second_executor: Executor, reference: Reference, num_tokens: int
) -> None:
    # Prefill on the first executor; the second imports the KV (at 40 tokens in two calls:
    # the first two blocks, then the rest from table index 2, as after a cached prefix) and
    # decodes greedily: the reference's tokens, and the source's own.
    source, target = executor, second_executor
    if source.info.kv_layout != target.info.kv_layout:
        pytest.fail(f"the two executors report different KV layouts:\n{source.info.kv_layout}"
                    f"\n{target.info.kv_layout}")
    rid = f"handoff-move-{num_tokens}"
    prompt = _prompt(source.info.vocab_size, num_tokens, seed=num_tokens)
    first = _prefill(source, rid, prompt)
    n = _blocks_for(source, num_tokens)
    table = target.blocks.take(n)
    split = 2 if num_tokens == 40 else 0
    try:
        if split:
            reply = target.stub.ImportKV(pb.ImportKVRequest(
                source_address=source.address, request_id=rid,
                num_tokens=split * source.info.block_size, block_ids=table[:split]), timeout=60)
            assert reply.num_blocks == split
        reply = target.stub.ImportKV(pb.ImportKVRequest(
            source_address=source.address, request_id=rid, first_block_index=split,
            num_tokens=num_tokens, block_ids=table[split:]), timeout=60)
        assert (reply.num_blocks, reply.num_bytes) == (
            n - split, (n - split) * source.info.kv_layout.bytes_per_block)
        moved = [first, *_decode(target, rid, _adopt(target, rid, table, prompt, first), 4)]
        stayed = [first, *_decode(source, rid, int(source.execute(
            source.work(rid, [first])).tokens[0].token_id), 4)]
    finally:
        target.tables.setdefault(rid, table)
        target.forget(rid)
        source.forget(rid)
    assert moved == stayed == reference_generate(reference, prompt, 6)
