"""KV hand-off between two simulated executors on loopback: the slot cache's digests move
block by block, and the target continues the request as the source and the token model do."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from executor_svc.simulated.runner import SimulatedRunner, build_simulated_runner
from executor_svc.simulated.settings import SimulatedSettings
from pagedkv.executor.v1 import executor_pb2 as pb

from .handoff_servers import Gateway, Served, serve_runner

pytestmark = pytest.mark.service

TINY = str(Path(__file__).resolve().parents[2] / "models" / "tiny-llama")  # vocab 512, EOS 2
NUM_BLOCKS = 64


def _runner(**overrides: object) -> SimulatedRunner:
    base: dict[str, object] = {"model": TINY, "time_scale": 0.0, "num_blocks": NUM_BLOCKS,
                               "num_cpu_blocks": 8, **overrides}
    return build_simulated_runner(SimulatedSettings(**base))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Served, Served, SimulatedRunner]]:
    source, target = _runner(), _runner(role="decode")
    a, b = serve_runner(source), serve_runner(target)
    yield a, b, source
    a.close()
    b.close()


def _gateways(a: Served, b: Served) -> tuple[Gateway, Gateway]:
    high = list(range(NUM_BLOCKS // 2, NUM_BLOCKS))
    random.Random(1).shuffle(high)
    return Gateway.of(a, list(range(NUM_BLOCKS // 2))), Gateway.of(b, high)


def test_simulated_handoff_describe_reports_role_and_slot_layout(
    pair: tuple[Served, Served, SimulatedRunner]
) -> None:
    # The slot cache's own format: 8 bytes a slot; the layers and heads of the config.
    a, b, _ = pair
    info = b.stub.Describe(pb.DescribeRequest())
    layout = info.kv_layout
    assert info.role == "decode" and a.stub.Describe(pb.DescribeRequest()).role == "both"
    assert (layout.format, layout.bytes_per_block, layout.block_size) == (
        "simulated-slot-digest-v1", 8 * 16, 16)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (2, 2, 16)
    assert layout.model_fingerprint == info.model_fingerprint


@pytest.mark.parametrize("num_tokens", [19, 48])
def test_simulated_handoff_target_continues_like_the_token_model(
    pair: tuple[Served, Served, SimulatedRunner], num_tokens: int
) -> None:
    # Prefill on A, import into B's blocks, decode 5 more on each: the same tokens, the
    # token model's greedy continuation.
    a, b, source_runner = pair
    source, target = _gateways(a, b)
    rid = f"sim-{num_tokens}"
    prompt = [random.Random(num_tokens).randrange(3, 512) for _ in range(num_tokens)]
    first = source.step(rid, prompt, new=True)
    reply = target.import_kv(a.address, rid, num_tokens, target.take(-(-num_tokens // 16)))
    assert reply.num_bytes == reply.num_blocks * 8 * 16
    moved = [first, *target.generate(rid, target.step(rid, [first], prompt, new=True), 5)]
    stayed = [first, *source.generate(rid, source.step(rid, [first]), 5)]
    assert moved == stayed == source_runner.tokens.generate(prompt, 6)


def test_simulated_handoff_after_a_prefix_the_target_computed_itself(
    pair: tuple[Served, Served, SimulatedRunner]
) -> None:
    # B computed the first 32 tokens itself (another request, the same prefix: a prefix-cache
    # hit); the import moves table index 2 on, and B's table is its prefix + the moved block.
    a, b, source_runner = pair
    source, target = _gateways(a, b)
    prompt = [random.Random(7).randrange(3, 512) for _ in range(40)]
    first = source.step("sim-prefixed", prompt, new=True)
    target.step("sim-prefix", prompt[:32], new=True)
    target.tables["sim-prefixed"] = target.tables["sim-prefix"][:2]
    target.import_kv(a.address, "sim-prefixed", 40, target.take(1), first_block_index=2)
    moved = [first, *target.generate(
        "sim-prefixed", target.step("sim-prefixed", [first], prompt, new=True), 4)]
    assert moved == source_runner.tokens.generate(prompt, 5)


def test_simulated_handoff_refuses_another_layout(
    pair: tuple[Served, Served, SimulatedRunner]
) -> None:
    # A simulated executor with another block size: FAILED_PRECONDITION naming block_size.
    a, _, _ = pair
    source, _ = _gateways(a, a)
    source.step("sim-held", list(range(3, 40)), new=True)
    other = serve_runner(_runner(block_size=8))
    try:
        with pytest.raises(grpc.RpcError) as info:
            other.stub.ImportKV(pb.ImportKVRequest(
                source_address=a.address, request_id="sim-held", num_tokens=37,
                block_ids=[1, 2, 3, 4, 5]), timeout=30)
    finally:
        other.close()
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "block_size" in (info.value.details() or "")


def test_an_import_writes_after_the_execute_it_names(
    pair: tuple[Served, Served, SimulatedRunner]
) -> None:
    # The target's allocator freed block `freed` (swapped its request out) in the Step before
    # the reservation that hands that block to an import; the Execute carrying the swap-out
    # copy is still queued behind a slow one. Naming that Execute (previous_step_id), the
    # import's write lands after the copy: the CPU block holds the swapped request's KV, the
    # device block the imported one's.
    a, _, _ = pair
    slow = _runner(time_scale=40.0)  # a step sleeps 40 x its modelled time: ~0.6 s
    t = serve_runner(slow)
    try:
        source, target = Gateway.of(a, list(range(NUM_BLOCKS // 2))), Gateway.of(
            t, list(range(NUM_BLOCKS)))
        target.step("swapped", list(range(3, 19)), new=True)  # 16 tokens: one full block
        (freed,) = target.tables["swapped"]
        kept = list(slow.cache.device[freed * 16:(freed + 1) * 16])
        source.step("moved", list(range(100, 116)), new=True)
        pool = ThreadPoolExecutor(2)
        busy = pool.submit(target.stub.Execute, pb.ExecuteRequest(  # slow: a 64-token prefill
            seqs=[pb.SequenceWork(request_id="other", token_ids=list(range(5, 69)),
                                  start_position=0, sample=True,
                                  sampling=pb.SamplingParams(),
                                  delta=pb.BlockTableDelta(block_ids=target.take(4)))],
            step_id=11), timeout=60)
        copy = pool.submit(target.stub.Execute, pb.ExecuteRequest(
            swap_out=[pb.BlockCopy(src_block_id=freed, dst_block_id=0)], step_id=12,
            previous_step_id=11), timeout=60)
        time.sleep(0.1)  # both queued: the import arrives while the copy waits
        target.stub.ImportKV(pb.ImportKVRequest(
            source_address=a.address, request_id="moved", block_ids=[freed], num_tokens=16,
            previous_step_id=12), timeout=60)
        busy.result(60), copy.result(60)
        pool.shutdown()
        assert list(slow.cache.host[0:16]) == kept  # swapped out before the import wrote
        assert list(slow.cache.device[freed * 16:(freed + 1) * 16]) != kept
    finally:
        t.close()


def test_an_import_naming_an_execute_that_never_comes_is_refused(
    pair: tuple[Served, Served, SimulatedRunner]
) -> None:
    a, b, _ = pair
    Gateway.of(a, list(range(NUM_BLOCKS // 2))).step("orphaned", list(range(3, 20)), new=True)
    with pytest.raises(grpc.RpcError) as info:
        b.stub.ImportKV(pb.ImportKVRequest(
            source_address=a.address, request_id="orphaned", block_ids=[40, 41], num_tokens=17,
            previous_step_id=987654321), timeout=30)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "previous_step_id 987654321" in (info.value.details() or "")
