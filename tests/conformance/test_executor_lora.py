"""LoRA in the executor contract: an executor that reports max_loras loads PEFT adapters
(LoadLoraAdapter), runs rows of several adapters and of the base model in one Execute, each
equal to PEFT's model of its adapter, keeps an adapter while a request holds it, and refuses
what it cannot serve with the statuses the proto names. One that reports 0 refuses both."""

from __future__ import annotations

import random
from pathlib import Path

import grpc
import pytest
from peft import PeftModel

from pagedkv.executor.v1 import executor_pb2 as pb
from tools.make_lora_adapter import make_adapter

from .conftest import (
    SIMULATED_SKIP,
    Executor,
    Reference,
    is_simulated,
    reference_dir,
    reference_generate,
    require_optional,
)

pytestmark = pytest.mark.conformance


@pytest.fixture(scope="module")
def lora_dir(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = pytestconfig.getoption("lora_dir")
    return Path(given) if given else tmp_path_factory.mktemp("lora")


def adapter(pytestconfig: pytest.Config, executor: Executor, lora_dir: Path, name: str,
            **kwargs: object) -> Path:
    path = lora_dir / f"{executor.info.instance_id[:8]}-{name}"
    if not path.exists():
        make_adapter(reference_dir(pytestconfig, executor), path, **kwargs)  # type: ignore[arg-type]
    return path


def load(executor: Executor, name: str, path: Path) -> pb.LoraAdapter:
    return executor.stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(name=name, path=str(path)))


def unload_all(executor: Executor) -> None:
    for loaded in executor.stub.Describe(pb.DescribeRequest()).lora_adapters:
        executor.stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(name=loaded.name))


def peft_generate(reference: Reference, adapter: Path | None, prompt: list[int],
                  num_new: int) -> list[int]:
    """PEFT's model of `adapter` over the reference (None: the reference alone); PEFT's
    layers are taken out again afterwards, leaving the shared reference as it was."""
    if adapter is None:
        return reference_generate(reference, prompt, num_new)
    model = PeftModel.from_pretrained(reference, adapter).eval()
    try:
        return reference_generate(model, prompt, num_new)
    finally:
        model.unload()


def refused(call: object, code: grpc.StatusCode, needle: str = "") -> None:
    with pytest.raises(grpc.RpcError) as info:
        call()  # type: ignore[operator]
    assert info.value.code() == code, info.value.details()
    assert needle in (info.value.details() or "")


def require_lora(executor: Executor) -> None:
    if is_simulated(executor) and not executor.info.max_loras:
        pytest.skip(f"{SIMULATED_SKIP}: it has no weights for an adapter to change (its "
                    "refusals are checked by test_lora_is_what_describe_says); these cases "
                    "run against an executor with LoRA on, e.g. this project's real one: "
                    ".venv/bin/python -m pytest -q tests/conformance -k lora")
    require_optional(executor, "max_loras", "lora_adapter")


def test_lora_is_what_describe_says(pytestconfig: pytest.Config, executor: Executor,
                                    lora_dir: Path) -> None:
    """max_loras 0: a load and a request naming an adapter are UNIMPLEMENTED; otherwise an
    adapter of its rank loads, and Describe lists it until it is unloaded."""
    info = executor.info
    if not info.max_loras:
        refused(lambda: load(executor, "a", lora_dir), grpc.StatusCode.UNIMPLEMENTED)
        work = executor.work("lora-off", [5, 6, 7])
        work.lora_adapter = "a"
        refused(lambda: executor.execute(work), grpc.StatusCode.UNIMPLEMENTED)
        executor.held.pop("lora-off")
        executor.forget("lora-off")
        return
    assert info.max_lora_rank >= 1
    unload_all(executor)
    path = adapter(pytestconfig, executor, lora_dir, "full", rank=info.max_lora_rank, seed=5)
    loaded = load(executor, "full", path)
    assert (loaded.name, loaded.rank, loaded.path) == ("full", info.max_lora_rank, str(path))
    assert list(executor.stub.Describe(pb.DescribeRequest()).lora_adapters) == [loaded]
    unload_all(executor)
    assert not executor.stub.Describe(pb.DescribeRequest()).lora_adapters


def test_adapters_and_the_base_model_share_a_step_and_equal_peft(
        pytestconfig: pytest.Config, executor: Executor, reference: Reference,
        lora_dir: Path) -> None:
    require_lora(executor)
    rank = min(8, executor.info.max_lora_rank)
    dirs = {"a": adapter(pytestconfig, executor, lora_dir, "a", rank=rank, seed=1),
            "b": adapter(pytestconfig, executor, lora_dir, "b", rank=rank, seed=2,
                         targets=("q_proj", "v_proj"))}
    unload_all(executor)
    names = ["a", "b"][:executor.info.max_loras]
    loaded = {name: load(executor, name, dirs[name]) for name in names}
    assert all(len(a.digest) == 64 and a.rank == rank for a in loaded.values())
    described = executor.stub.Describe(pb.DescribeRequest()).lora_adapters
    assert {a.name: a.digest for a in described} == {n: a.digest for n, a in loaded.items()}
    assert load(executor, names[0], dirs[names[0]]) == loaded[names[0]]  # again: the same
    prompt = [random.Random(3).randrange(3, executor.info.vocab_size) for _ in range(11)]
    rows = {f"lora-{name or 'base'}": name for name in ["", *names]}
    works = []
    for rid, name in rows.items():
        work = executor.work(rid, prompt)
        work.lora_adapter = name
        works.append(work)
    out = {t.request_id: [t.token_id] for t in executor.execute(*works).tokens}
    for _ in range(7):
        steps = [executor.work(rid, [tokens[-1]]) for rid, tokens in out.items()]
        for token in executor.execute(*steps).tokens:
            out[token.request_id].append(token.token_id)
    for rid, name in rows.items():
        assert out[rid] == peft_generate(reference, dirs.get(name), prompt, 8), name
    if len(names) == 2:
        assert len({tuple(v) for v in out.values()}) == 3  # the adapters change the output
    executor.forget(*rows)
    unload_all(executor)


def test_an_adapter_is_kept_while_a_request_holds_it_and_refusals(
        pytestconfig: pytest.Config, executor: Executor, lora_dir: Path) -> None:
    require_lora(executor)
    info = executor.info
    a = adapter(pytestconfig, executor, lora_dir, "a", rank=min(8, info.max_lora_rank), seed=1)
    other = adapter(pytestconfig, executor, lora_dir, "b", rank=min(8, info.max_lora_rank),
                    seed=2, targets=("q_proj", "v_proj"))
    wide = adapter(pytestconfig, executor, lora_dir, "wide", rank=info.max_lora_rank + 1)
    unload_all(executor)
    code = grpc.StatusCode
    refused(lambda: load(executor, "x", lora_dir / "missing"), code.NOT_FOUND)
    refused(lambda: load(executor, "x", wide), code.INVALID_ARGUMENT, "rank")
    refused(lambda: load(executor, "", a), code.INVALID_ARGUMENT)
    load(executor, "a", a)
    refused(lambda: load(executor, "a", other), code.ALREADY_EXISTS)
    work = executor.work("lora-held", [5, 6, 7])
    work.lora_adapter = "a"
    token = executor.execute(work).tokens[0].token_id
    refused(lambda: executor.stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(name="a")),
            code.FAILED_PRECONDITION)
    again = executor.work("lora-held", [token])
    again.lora_adapter = "a"  # only on the first step
    refused(lambda: executor.execute(again), code.INVALID_ARGUMENT)
    executor.held["lora-held"] -= 1
    executor.forget("lora-held")
    executor.stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(name="a"))
    refused(lambda: executor.stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(name="a")),
            code.NOT_FOUND)
    gone = executor.work("lora-gone", [5, 6, 7])
    gone.lora_adapter = "a"
    refused(lambda: executor.execute(gone), code.NOT_FOUND)
    executor.held.pop("lora-gone")
    executor.forget("lora-gone")
    for i in range(info.max_loras):
        load(executor, f"fill-{i}", a)
    refused(lambda: load(executor, "one-more", other), code.RESOURCE_EXHAUSTED)
    unload_all(executor)
