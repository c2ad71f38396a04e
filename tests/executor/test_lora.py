"""LoRA at the executor: several adapters and the base model in one batch, each row equal to
PEFT's own model (the adapter applied by PEFT, transformers' greedy generate), and what
loading, unloading and naming adapters refuses (executor.v1 LoadLoraAdapter, SequenceWork.
lora_adapter)."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file

from common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unimplemented,
)
from executor_svc.runner import ModelRunner
from executor_svc.simulated.runner import build_simulated_runner
from executor_svc.simulated.settings import SimulatedSettings
from executor_svc.step import BlockTableDelta, SamplingParams, SequenceWork, StepRequest
from tests.executor.oracle import MODELS, Driver, reference_generate, reference_model
from tools.make_lora_adapter import make_adapter

# Ranks under, at and over the slots' rank; one adapter of two projections only.
ADAPTERS = {"a": {"rank": 8, "seed": 1},
            "b": {"rank": 16, "seed": 2, "targets": ("q_proj", "v_proj")},
            "c": {"rank": 4, "seed": 3, "alpha": 8}}


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    dirs = {name: make_adapter(MODELS / "tiny-llama", root / name, **kw)  # type: ignore[arg-type]
            for name, kw in ADAPTERS.items()}
    dirs["rank32"] = make_adapter(MODELS / "tiny-llama", root / "rank32", rank=32)
    dirs["qwen"] = make_adapter(MODELS / "tiny-qwen2", root / "qwen", rank=8)
    return dirs


@pytest.fixture
def lora_runner(make_runner: Callable[..., ModelRunner]) -> ModelRunner:
    return make_runner(enable_lora=True, max_loras=2, max_lora_rank=16)


def peft_generate(runner: ModelRunner, adapter: Path | None, prompt: list[int],
                  num_new: int) -> list[int]:
    model = reference_model(runner)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    return reference_generate(model, prompt, num_new)


def prompts(seed: int, sizes: list[int], vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in sizes]


@pytest.mark.parametrize("chunk", [None, 5])
def test_adapters_and_the_base_model_in_one_batch_equal_peft(
    lora_runner: ModelRunner, adapter_dirs: dict[str, Path], chunk: int | None
) -> None:
    """One prompt under adapter a, adapter b and the base model, and two more prompts, all in
    the same steps (prefill whole or in chunks, then decode): every row equals PEFT's model
    of its adapter, and the adapters change the output."""
    for name in ("a", "b"):
        lora_runner.load_lora_adapter(name, str(adapter_dirs[name]))
    shared, other, short = prompts(11, [13, 21, 6], lora_runner.info.vocab_size)
    rows = {"sa": (shared, "a"), "sb": (shared, "b"), "s": (shared, ""),
            "oa": (other, "a"), "ob": (short, "b")}
    driver = Driver.scattered(lora_runner)
    driver.lora_adapters = {rid: name for rid, (_, name) in rows.items()}
    got = driver.generate({rid: p for rid, (p, _) in rows.items()}, 10, chunk=chunk)
    expected = {rid: peft_generate(lora_runner, adapter_dirs[name] if name else None, p, 10)
                for rid, (p, name) in rows.items()}
    assert got == expected
    assert len({tuple(expected[r]) for r in ("sa", "sb", "s")}) == 3


def test_a_freed_slot_serves_the_next_adapter_exactly(
    lora_runner: ModelRunner, adapter_dirs: dict[str, Path]
) -> None:
    """a (rank 8) unloaded, c (rank 4) loaded into its slot: c's rows equal PEFT's, so none
    of a's weights were left behind in the rows c does not fill."""
    for name in ("a", "b"):
        lora_runner.load_lora_adapter(name, str(adapter_dirs[name]))
    lora_runner.unload_lora_adapter("a")
    info = lora_runner.load_lora_adapter("c", str(adapter_dirs["c"]))
    assert (info.name, info.rank) == ("c", 4)
    assert [a.name for a in lora_runner.info.lora_adapters] == ["c", "b"]
    (prompt,) = prompts(12, [9], lora_runner.info.vocab_size)
    driver = Driver.scattered(lora_runner)
    driver.lora_adapters = {"x": "c"}
    assert driver.generate({"x": prompt}, 8) == {
        "x": peft_generate(lora_runner, adapter_dirs["c"], prompt, 8)}


def test_describe_reports_slots_and_adapters(lora_runner: ModelRunner,
                                             adapter_dirs: dict[str, Path]) -> None:
    info = lora_runner.info
    assert (info.max_loras, info.max_lora_rank, info.lora_adapters) == (2, 16, ())
    loaded = lora_runner.load_lora_adapter("a", str(adapter_dirs["a"]))
    assert lora_runner.info.lora_adapters == (loaded,)
    assert (loaded.rank, len(loaded.digest), loaded.path) == (8, 64, str(adapter_dirs["a"]))
    # The same contents again, under the same name: already loaded, the same adapter, and
    # nothing changed (the generation orders Describe answers: it counts changes only).
    assert lora_runner.load_lora_adapter("a", str(adapter_dirs["a"])) == loaded
    assert lora_runner.info.lora_generation == 1
    lora_runner.unload_lora_adapter("a")
    assert lora_runner.info.lora_generation == 2


def new_request(rid: str, adapter: str, prompt: tuple[int, ...] = (5, 6, 7),
                blocks: tuple[int, ...] = (1,)) -> StepRequest:
    return StepRequest(seqs=(SequenceWork(rid, prompt, 0, BlockTableDelta(0, blocks),
                                          SamplingParams(), True, lora_adapter=adapter),))


def test_an_adapter_in_use_is_not_unloaded(lora_runner: ModelRunner,
                                           adapter_dirs: dict[str, Path]) -> None:
    lora_runner.load_lora_adapter("a", str(adapter_dirs["a"]))
    lora_runner.execute(new_request("r", "a"))
    with pytest.raises(FailedPrecondition, match="in use by 1 request"):
        lora_runner.unload_lora_adapter("a")
    # Still served: its request goes on.
    lora_runner.execute(StepRequest(seqs=(SequenceWork("r", (9,), 3, None, None, True),)))
    lora_runner.release(("r",))
    lora_runner.unload_lora_adapter("a")
    assert lora_runner.info.lora_adapters == ()
    with pytest.raises(NotFound, match="'a' is not loaded on this executor"):
        lora_runner.execute(new_request("s", "a"))
    assert "s" not in lora_runner.requests


def test_refusals(lora_runner: ModelRunner, adapter_dirs: dict[str, Path],
                  tmp_path: Path) -> None:
    load = lora_runner.load_lora_adapter
    with pytest.raises(NotFound, match="no adapter directory at"):
        load("x", str(tmp_path / "missing"))
    with pytest.raises(InvalidArgument, match="has no adapter_config.json"):
        load("x", str(tmp_path))
    with pytest.raises(InvalidArgument, match="rank 32, over this executor's --max-lora-rank 16"):
        load("x", str(adapter_dirs["rank32"]))
    with pytest.raises(InvalidArgument, match="trained for another base model"):
        load("x", str(adapter_dirs["qwen"]))
    with pytest.raises(InvalidArgument, match="printable ASCII"):
        load("", str(adapter_dirs["a"]))
    dora = tmp_path / "dora"
    shutil.copytree(adapter_dirs["a"], dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(InvalidArgument, match="DoRA adapters are not supported"):
        load("x", str(dora))
    nan = tmp_path / "nan"
    shutil.copytree(adapter_dirs["a"], nan)
    tensors = load_file(nan / "adapter_model.safetensors")
    next(iter(tensors.values()))[0, 0] = float("nan")
    save_file(tensors, nan / "adapter_model.safetensors")
    with pytest.raises(InvalidArgument, match="NaN or infinite"):
        load("x", str(nan))
    assert lora_runner.info.lora_adapters == ()  # nothing refused was loaded
    load("a", str(adapter_dirs["a"]))
    with pytest.raises(AlreadyExists, match="loaded with other weights"):
        load("a", str(adapter_dirs["c"]))
    load("b", str(adapter_dirs["b"]))
    with pytest.raises(ResourceExhausted, match="all 2 adapter slots"):
        load("c", str(adapter_dirs["c"]))
    with pytest.raises(NotFound, match="no adapter named 'zz'"):
        lora_runner.unload_lora_adapter("zz")
    lora_runner.execute(new_request("r", "a"))
    held = StepRequest(seqs=(SequenceWork("r", (9,), 3, None, None, True, lora_adapter="a"),))
    with pytest.raises(InvalidArgument, match="send lora_adapter only on its first step"):
        lora_runner.execute(held)


def test_executors_without_lora_refuse_it(make_runner: Callable[..., ModelRunner],
                                          adapter_dirs: dict[str, Path]) -> None:
    for runner in (make_runner(), build_simulated_runner(SimulatedSettings())):
        assert runner.info.max_loras == 0
        with pytest.raises(Unimplemented, match="max_loras is 0"):
            runner.load_lora_adapter("a", str(adapter_dirs["a"]))
        with pytest.raises(Unimplemented, match="serves no LoRA adapters"):
            runner.execute(new_request("r", "a"))
        assert "r" not in runner.requests


def test_base_model_rows_are_the_base_models_bit_for_bit(
    matmul_library: str, make_runner: Callable[..., ModelRunner],
    adapter_dirs: dict[str, Path]
) -> None:
    """Adapters change nothing for base-model rows: alone, and beside adapter rows in one
    step, their logits equal those of an executor without LoRA given the same step. Bit for
    bit where MKL computes float32 (Intel CPUs); where oneDNN does, the executor without LoRA
    runs q/k/v as one matmul and SiLU in the gate's epilogue, which LoRA's wrapped projections
    cannot, so the same sums round apart (float32 rounding; an adapter's delta is far larger)."""
    lora_runner = make_runner(enable_lora=True, max_loras=2, max_lora_rank=16)
    for name in ("a", "b"):
        lora_runner.load_lora_adapter(name, str(adapter_dirs[name]))
    plain = make_runner()
    alone = new_request("r", "", tuple(range(3, 17)))
    base_alone = lora_runner.run_forward(alone).logits, plain.run_forward(alone).logits
    if matmul_library == "mkl":
        assert torch.equal(*base_alone)
    else:
        torch.testing.assert_close(*base_alone, rtol=1e-5, atol=1e-5)
    rows = [("x", "a", (5, 6, 7, 8)), ("y", "", (9, 10, 11)), ("z", "b", (12, 13)),
            ("w", "", (14, 15, 16, 17, 18))]

    def mixed(with_adapters: bool) -> StepRequest:
        return StepRequest(seqs=tuple(
            SequenceWork(rid, tokens, 0, BlockTableDelta(0, (30 + i,)), SamplingParams(), True,
                         lora_adapter=name if with_adapters else "")
            for i, (rid, name, tokens) in enumerate(rows)))

    got = lora_runner.run_forward(mixed(True)).logits
    want = plain.run_forward(mixed(False)).logits
    if matmul_library == "mkl":
        assert torch.equal(got[[1, 3]], want[[1, 3]])  # the base rows
    else:
        torch.testing.assert_close(got[[1, 3]], want[[1, 3]], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got[[0, 2]], want[[0, 2]], rtol=1e-3, atol=1e-3)  # adapter rows


def test_a_request_admitted_for_other_contents_is_refused(
    lora_runner: ModelRunner, adapter_dirs: dict[str, Path]
) -> None:
    """The caller hashed the request's blocks under a digest: the adapter under that name
    must have it (the name may have been reloaded with other weights meanwhile)."""
    loaded = lora_runner.load_lora_adapter("a", str(adapter_dirs["a"]))
    step = new_request("r", "a")
    stale = StepRequest(seqs=(replace(step.seqs[0], lora_adapter_digest="0" * 64),))
    with pytest.raises(FailedPrecondition, match="it was replaced"):
        lora_runner.execute(stale)
    assert "r" not in lora_runner.requests
    current = StepRequest(seqs=(replace(step.seqs[0], lora_adapter_digest=loaded.digest),))
    lora_runner.execute(current)


def test_an_adapter_whose_modules_disagree_with_its_rank_is_refused(
    lora_runner: ModelRunner, adapter_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """Per-module ranks are PEFT's rank_pattern, which is refused; a file whose A matrices
    do not have the config's r is refused too, and so is a config without a usable r."""
    odd = tmp_path / "odd"
    shutil.copytree(adapter_dirs["a"], odd)
    tensors = load_file(odd / "adapter_model.safetensors")
    key = next(k for k in tensors if "q_proj.lora_A" in k)
    tensors[key] = tensors[key][:4].contiguous()
    tensors[key.replace("lora_A", "lora_B")] = tensors[key.replace("lora_A", "lora_B")][:, :4]
    save_file({k: v.contiguous() for k, v in tensors.items()}, odd / "adapter_model.safetensors")
    with pytest.raises(InvalidArgument, match="lora_A has rank 4, not the config's r=8"):
        lora_runner.load_lora_adapter("x", str(odd))
    config = json.loads((adapter_dirs["a"] / "adapter_config.json").read_text())
    shutil.copy(adapter_dirs["a"] / "adapter_model.safetensors", odd)
    (odd / "adapter_config.json").write_text(json.dumps({**config, "r": 0}))
    with pytest.raises(InvalidArgument, match="needs an integer r >= 1"):
        lora_runner.load_lora_adapter("x", str(odd))
    assert lora_runner.info.lora_adapters == () and lora_runner.info.lora_generation == 0


def test_drafts_of_an_adapters_request_are_verified_with_its_adapter(
    lora_runner: ModelRunner, adapter_dirs: dict[str, Path]
) -> None:
    """Speculative decoding beside LoRA: drafts equal to PEFT's greedy tokens are all
    accepted, and the token after them is PEFT's (the base model's would differ)."""
    lora_runner.load_lora_adapter("a", str(adapter_dirs["a"]))
    (prompt,) = prompts(13, [10], lora_runner.info.vocab_size)
    expected = peft_generate(lora_runner, adapter_dirs["a"], prompt, 9)
    assert expected != peft_generate(lora_runner, None, prompt, 9)
    step = new_request("d", "a", tuple(prompt), blocks=(40, 41, 42))
    first = lora_runner.execute(step).tokens[0].token_id
    assert first == expected[0]
    out, position = [first], len(prompt)
    while len(out) < 9:
        drafts = tuple(expected[len(out):len(out) + 4])
        step = StepRequest(seqs=(SequenceWork("d", (out[-1], *drafts), position, None, None,
                                              True, num_draft_tokens=len(drafts)),))
        (token,) = lora_runner.execute(step).tokens
        assert token.num_accepted_draft_tokens == len(drafts)
        out += [*drafts, token.token_id]
        position += 1 + len(drafts)
    assert out[:9] == expected
