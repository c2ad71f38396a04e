"""KV hand-off between two real executors on loopback (tiny-llama, the same seeded dummy
weights): a request prefilled on A, its KV imported by B, decodes on B exactly as on A and as
transformers' greedy generate; every error status of ImportKV and ExportKV."""

from __future__ import annotations

import asyncio
import random
import socket
import threading
from collections.abc import Iterator

import grpc
import pytest
from structlog.testing import capture_logs
from transformers import PreTrainedModel

from common.auth import Access
from common.credentials import RoleTokens
from common.executor_description import ExecutorDescription
from common.kv_layout import KVLayout
from common.metrics import service_registry
from executor_svc.kv_transfer import crc32
from executor_svc.runner import ModelRunner, build_runner
from executor_svc.service import ExecutorServicer, StepMetrics
from executor_svc.serving import METHOD_ROLES
from gateway.clients.call_failures import Lost, Stale, Unknown
from gateway.clients.executor_client import ExecutorClient, KVImport
from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.executor.v1 import executor_pb2_grpc as pb_grpc

from .handoff_servers import (
    AUTH,
    EXECUTOR_AUTH,
    FaultySource,
    Gateway,
    Served,
    serve,
    serve_runner,
)
from .oracle import make_settings, random_prompts, reference_generate, reference_model

pytestmark = pytest.mark.service

NUM_BLOCKS = 64
NUM_NEW = 6


def _runner(**overrides: object) -> ModelRunner:
    return build_runner(make_settings("tiny-llama", num_blocks=NUM_BLOCKS, **overrides))


@pytest.fixture(scope="module")
def executors() -> Iterator[dict[str, Served]]:
    """a/b: the same weights (seed 1234), block size 16; a8/b8: block size 8; other: seed 99."""
    specs = {"a": {}, "b": {}, "a8": {"block_size": 8}, "b8": {"block_size": 8},
             "other": {"seed": 99}}
    served = {name: serve_runner(_runner(**spec)) for name, spec in specs.items()}
    yield served
    for s in served.values():
        s.close()


@pytest.fixture(scope="module")
def reference(executors: dict[str, Served]) -> PreTrainedModel:
    servicer = executors["a"].servicer
    return reference_model(servicer._runner)  # type: ignore[attr-defined]


def _gateways(executors: dict[str, Served], suffix: str = "") -> tuple[Gateway, Gateway]:
    """The source's blocks from the low half, the target's scattered over the high half:
    a block id never means the same block on both."""
    low, high = list(range(NUM_BLOCKS // 2)), list(range(NUM_BLOCKS // 2, NUM_BLOCKS))
    random.Random(len(suffix)).shuffle(high)
    return (Gateway.of(executors["a" + suffix], low), Gateway.of(executors["b" + suffix], high))


def _code(call: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        result = call()  # type: ignore[operator]
        list(result) if not isinstance(result, pb.ImportKVResponse) else None
    return info.value.code(), info.value.details() or ""


@pytest.mark.parametrize(("suffix", "num_tokens"), [("", 37), ("", 32), ("8", 21)])
def test_kv_handoff_target_decodes_like_source_and_generate(
    executors: dict[str, Served], reference: PreTrainedModel, suffix: str, num_tokens: int
) -> None:
    # Prefill on A, import into B's own block ids (a partial last block at 37 and 21 tokens,
    # block sizes 16 and 8), then the same greedy decode on both: tokens equal each other and
    # transformers' generate.
    source, target = _gateways(executors, suffix)
    rid = f"move-{suffix}-{num_tokens}"
    prompt = random_prompts(512, [num_tokens], seed=num_tokens)[0]
    first = source.step(rid, prompt, new=True)
    num_blocks = -(-num_tokens // source.block_size)
    reply = target.import_kv(source.served.address, rid, num_tokens, target.take(num_blocks))
    layout = target.stub.Describe(pb.DescribeRequest()).kv_layout
    assert (reply.num_blocks, reply.num_bytes) == (num_blocks, num_blocks * layout.bytes_per_block)
    assert reply.elapsed_ms > 0
    moved = [first, *target.generate(rid, target.step(rid, [first], prompt, new=True), NUM_NEW)]
    stayed = [first, *source.generate(rid, source.step(rid, [first]), NUM_NEW)]
    assert moved == stayed == reference_generate(reference, prompt, NUM_NEW + 1)


def test_kv_handoff_moves_only_the_blocks_after_a_prefix_already_there(
    executors: dict[str, Served], reference: PreTrainedModel
) -> None:
    # B already holds the first two blocks (an earlier import of the first 32 tokens, as a
    # cached prefix would be): the second import moves table index 2 on, and B decodes on
    # the table [prefix blocks, moved block].
    source, target = _gateways(executors)
    prompt = random_prompts(512, [40], seed=40)[0]
    first = source.step("prefixed", prompt, new=True)
    prefix = target.take(2)
    assert target.import_kv(source.served.address, "prefixed", 32, prefix).num_blocks == 2
    reply = target.import_kv(source.served.address, "prefixed", 40, target.take(1),
                             first_block_index=2)
    assert reply.num_blocks == 1 and target.tables["prefixed"][:2] == prefix
    moved = [first, *target.generate("prefixed",
                                     target.step("prefixed", [first], prompt, new=True), NUM_NEW)]
    assert moved == reference_generate(reference, prompt, NUM_NEW + 1)


def test_kv_handoff_export_streams_each_block_with_its_crc(executors: dict[str, Served]) -> None:
    # One message per block in table order, bytes_per_block long, crc32 of the bytes, and
    # the bytes are kv[:, :, block_id] of the source's cache.
    source, _ = _gateways(executors)
    prompt = random_prompts(512, [37], seed=3)[0]
    source.step("exported", prompt, new=True)
    info = source.stub.Describe(pb.DescribeRequest())
    assert info.role == "both"
    assert (info.kv_layout.format, info.kv_layout.dtype, info.kv_layout.block_size) == (
        "torch-kv-v1", "float32", 16)
    assert (info.kv_layout.num_layers, info.kv_layout.num_kv_heads, info.kv_layout.head_dim,
            info.kv_layout.bytes_per_block) == (2, 2, 16, 2 * 2 * 16 * 2 * 16 * 4)
    blocks = list(source.stub.ExportKV(pb.ExportKVRequest(
        request_id="exported", first_block_index=1, num_blocks=2, num_tokens=37,
        layout=info.kv_layout)))
    assert [b.block_index for b in blocks] == [1, 2]
    runner = source.served.servicer._runner  # type: ignore[attr-defined]
    for block, block_id in zip(blocks, source.tables["exported"][1:], strict=True):
        assert block.crc32 == crc32(block.data)
        assert block.data == runner.cache.kv[:, :, block_id].contiguous().numpy().tobytes()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_kv_handoff_errors_have_the_contract_statuses(executors: dict[str, Served]) -> None:
    # Every refusal: the target's own checks, the source's statuses passed through with
    # "source <addr>: ", an unreachable source, another layout (block size, weights).
    source, target = _gateways(executors)
    held = random_prompts(512, [37], seed=5)[0]
    source.step("held", held, new=True)
    addr = source.served.address
    layout = target.stub.Describe(pb.DescribeRequest()).kv_layout

    def imp(rid: str = "held", num_tokens: int = 37, ids: list[int] | None = None,
            first: int = 0, src: str = addr, on: Served | None = None) -> object:
        request = pb.ImportKVRequest(source_address=src, request_id=rid, num_tokens=num_tokens,
                                     first_block_index=first,
                                     block_ids=[40, 41, 42] if ids is None else ids)
        return lambda: (on or target.served).stub.ImportKV(request, timeout=30)

    invalid = [imp(rid=""), imp(num_tokens=0), imp(src=""), imp(ids=[40, 41]),
               imp(ids=[40, 41, NUM_BLOCKS]), imp(ids=[40, 41, 40]), imp(first=4, ids=[])]
    for call in invalid:
        assert _code(call)[0] == grpc.StatusCode.INVALID_ARGUMENT
    code, details = _code(imp(rid="nope"))
    assert code == grpc.StatusCode.NOT_FOUND and details.startswith(f"source {addr}: ")
    code, details = _code(imp(num_tokens=40))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and details.startswith(f"source {addr}")
    code, details = _code(imp(src=f"127.0.0.1:{_closed_port()}"))
    assert code == grpc.StatusCode.UNAVAILABLE, details
    code, details = _code(imp(on=executors["other"]))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "model_fingerprint" in details
    code, details = _code(imp(ids=[1, 2, 3, 4, 5], on=executors["b8"]))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "block_size" in details

    def exp(**fields: object) -> object:
        request = pb.ExportKVRequest(**{"request_id": "held", "num_blocks": 3,
                                        "num_tokens": 37, "layout": layout, **fields})
        return lambda: source.stub.ExportKV(request, timeout=30)

    assert _code(exp(request_id="nope"))[0] == grpc.StatusCode.NOT_FOUND
    assert _code(exp(num_tokens=38))[0] == grpc.StatusCode.FAILED_PRECONDITION
    assert _code(exp(first_block_index=1))[0] == grpc.StatusCode.INVALID_ARGUMENT
    other = pb.KVLayout()
    other.CopyFrom(layout)
    other.format = "another-format"
    code, details = _code(exp(layout=other))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "format" in details
    # The target keeps serving: a new request on it decodes.
    assert target.step("after", held, new=True) == source.step("again", held, new=True)


@pytest.mark.parametrize("fault", ["crc", "missing", "extra", "out_of_order", "short"])
def test_kv_handoff_a_broken_stream_is_data_loss(executors: dict[str, Served],
                                                 fault: str) -> None:
    # A test-only source sends a wrong checksum, too few or too many blocks, two out of
    # order, or a short block: DATA_LOSS, and the target serves Execute afterwards.
    _, target = _gateways(executors)
    layout = target.stub.Describe(pb.DescribeRequest()).kv_layout
    faulty = serve(FaultySource(fault, layout.bytes_per_block))
    try:
        code, details = _code(lambda: target.import_kv(faulty.address, "r", 37, [50, 51, 52]))
    finally:
        faulty.close()
    assert code == grpc.StatusCode.DATA_LOSS, details
    assert details.startswith(f"source {faulty.address}: ")
    assert target.step(f"after-{fault}", [5, 6, 7], new=True) >= 0


def test_kv_handoff_needs_the_executors_token(executors: dict[str, Served]) -> None:
    # ExportKV without the token is UNAUTHENTICATED; a source with another token refuses the
    # target, which says so as FAILED_PRECONDITION (a deployment's credentials differ).
    source, target = _gateways(executors)
    with grpc.insecure_channel(source.served.address) as channel:
        call = channel.unary_stream("/pagedkv.executor.v1.ExecutorService/ExportKV")
        with pytest.raises(grpc.RpcError) as info:
            list(call(pb.ExportKVRequest(request_id="x").SerializeToString(), timeout=10))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    stranger = serve(FaultySource("crc", 8), auth=RoleTokens.new().auth("executor"))
    try:
        code, details = _code(lambda: target.import_kv(stranger.address, "r", 37, [50, 51, 52]))
    finally:
        stranger.close()
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "credentials" in details


def test_kv_handoff_counts_and_logs_blocks_and_bytes() -> None:
    # Each side counts the blocks and bytes it moved and logs one line for the request.
    runners = [_runner(), _runner()]
    registries = [service_registry() for _ in runners]
    a, b = (serve_runner(r, StepMetrics(reg, r)) for r, reg in zip(runners, registries,
                                                                     strict=True))
    try:
        source, target = Gateway.of(a, list(range(8))), Gateway.of(b, list(range(8, 16)))
        source.step("NS0a1b2c/counted", list(range(3, 40)), new=True)
        with capture_logs() as logs:
            target.import_kv(a.address, "NS0a1b2c/counted", 37, target.take(3))
    finally:
        a.close()
        b.close()
    size = runners[0].info.kv_layout.bytes_per_block  # type: ignore[union-attr]
    sample = [r.get_sample_value for r in registries]
    assert (sample[0]("pagedkv_executor_kv_exported_blocks_total"),
            sample[0]("pagedkv_executor_kv_exported_bytes_total")) == (3, 3 * size)
    assert (sample[1]("pagedkv_executor_kv_imported_blocks_total"),
            sample[1]("pagedkv_executor_kv_imported_bytes_total")) == (3, 3 * size)
    assert sample[0]("pagedkv_executor_kv_imported_blocks_total") == 0
    done = {e["event"]: e for e in logs if e["event"].startswith("kv_")}
    assert set(done) == {"kv_export_done", "kv_import_done"}
    for event in done.values():
        assert (event["seq_id"], event["num_blocks"], event["num_bytes"]) == (
            "NS0a1b2c/counted", 3, 3 * size)
        assert event["ms"] > 0


def test_kv_handoff_through_the_gateways_executor_client(executors: dict[str, Served]) -> None:
    # ExecutorClient: describe() carries role and layout; import_kv returns what moved, and
    # a failure is the client's CallFailed (NOT_FOUND: Unknown, FAILED_PRECONDITION: Stale,
    # UNAVAILABLE: Lost).
    source, target = _gateways(executors)
    source.step("client-moved", list(range(3, 23)), new=True)
    ids = target.take(2)

    async def calls() -> tuple[ExecutorDescription, KVImport, tuple[type[Exception], ...]]:
        client = ExecutorClient(target.served.address, AUTH)
        try:
            described = await client.describe(timeout=10)
            moved = await client.import_kv(source.served.address, "client-moved", 0, ids, 20,
                                           timeout=30)
            failures: list[type[Exception]] = []
            for addr, rid, num_tokens in [(source.served.address, "nobody", 20),
                                          (source.served.address, "client-moved", 21),
                                          (f"127.0.0.1:{_closed_port()}", "x", 20)]:
                try:
                    await client.import_kv(addr, rid, 0, ids, num_tokens, timeout=30)
                except Exception as exc:  # noqa: BLE001 - the classes are what is checked
                    failures.append(type(exc))
            return described, moved, tuple(failures)
        finally:
            await client.close()

    described, moved, failures = asyncio.run(calls())
    layout = target.stub.Describe(pb.DescribeRequest()).kv_layout
    assert described.role == "both"
    assert described.kv_layout == KVLayout(
        layout.model_fingerprint, 16, "float32", 2, 2, 16, layout.bytes_per_block, "torch-kv-v1")
    assert (moved.num_blocks, moved.num_bytes) == (2, 2 * layout.bytes_per_block)
    assert failures == (Unknown, Stale, Lost)


def test_kv_handoff_runs_beside_steps_on_other_blocks(
    executors: dict[str, Served], reference: PreTrainedModel
) -> None:
    # While B decodes one request step after step (another thread, its own blocks), it
    # imports a second request four times: both decode as transformers' generate.
    source = Gateway.of(executors["a"], list(range(NUM_BLOCKS // 2)))
    busy = Gateway.of(executors["b"], list(range(32, 48)))
    target = Gateway.of(executors["b"], list(range(48, 64)))
    busy_prompt, prompt = random_prompts(512, [30, 45], seed=11)
    first = source.step("beside", prompt, new=True)
    busy_out = [busy.step("busy", busy_prompt, new=True)]

    def decode() -> None:
        busy_out.extend(busy.generate("busy", busy_out[0], 24)[1:])

    thread = threading.Thread(target=decode)
    thread.start()
    ids = target.take(3)
    for _ in range(4):
        target.import_kv(source.served.address, "beside", 45, ids)
    thread.join(timeout=120)
    moved = [first, *target.generate("beside", target.step("beside", [first], prompt, new=True),
                                     NUM_NEW)]
    assert moved == reference_generate(reference, prompt, NUM_NEW + 1)
    assert busy_out == reference_generate(reference, busy_prompt, 24)


def test_kv_handoff_under_the_role_table_executors_export_and_gateways_execute() -> None:
    # The executors' method table (executor_svc.serving): the hand-off passes (the gateway
    # asks ImportKV, the target pulls ExportKV with the executor's token); a gateway's token
    # may not ExportKV, an executor's may not Execute, Release, ImportKV or Describe.
    a, b = (serve(ExecutorServicer(_runner(), auth=EXECUTOR_AUTH), access=Access(METHOD_ROLES))
            for _ in range(2))
    try:
        source, target = Gateway.of(a, list(range(32))), Gateway.of(b, list(range(32, 64)))
        prompt = random_prompts(512, [20], seed=5)[0]
        source.step("roles", prompt, new=True)
        assert target.import_kv(a.address, "roles", 20, target.take(2)).num_blocks == 2
        code, details = _code(lambda: a.stub.ExportKV(
            pb.ExportKVRequest(request_id="roles", num_blocks=2), timeout=10))
        assert (code, details) == (grpc.StatusCode.PERMISSION_DENIED,
                                   "the gateway role's token may not call ExportKV: only "
                                   "executor may")
        with EXECUTOR_AUTH.channel(a.address) as channel:
            stub = pb_grpc.ExecutorServiceStub(channel)
            for name, request, only in (
                ("Execute", pb.ExecuteRequest(), "gateway"),
                ("Release", pb.ReleaseRequest(), "gateway"),
                ("ImportKV", pb.ImportKVRequest(), "gateway"),
                ("Describe", pb.DescribeRequest(), "allocator, gateway"),
            ):
                code, details = _code(
                    lambda name=name, request=request: getattr(stub, name)(request, timeout=10))
                assert (code, details) == (
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"the executor role's token may not call {name}: only {only} may")
    finally:
        a.close()
        b.close()
