"""Helpers for the end-to-end tests: real subprocesses on loopback, a transformers oracle."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import grpc
import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from common.structured_output import StructuredOutput
from executor_svc.model_loader import dummy_model
from executor_svc.simulated.token_model import TokenModel
from pagedkv.allocator.v1 import allocator_pb2 as apb
from pagedkv.allocator.v1 import allocator_pb2_grpc as apb_grpc
from pagedkv.gateway.v1 import gateway_pb2 as gpb
from pagedkv.gateway.v1 import gateway_pb2_grpc as gpb_grpc
from tests.executor.oracle import reference_constrained
from tools.launch import Stack, StackSpec

ROOT = Path(__file__).resolve().parents[2]
MODEL = str(ROOT / "models" / "tiny-llama")
DUMMY_SEED = 0


# The simulated executor (executor_svc/simulated): no model to load, its tokens a digest of the
# prefix each slot holds (a wrong block table gives other tokens, as a real model would): for
# the tests where the model's numbers do not matter (restarts, outages, leases).
SIMULATED_ARGS = ("--simulate-profile", "llama3-8b-h100", "--time-scale", "1",
                  "--num-blocks", "256", "--num-cpu-blocks", "32")
SIMULATED_TOKENS = TokenModel(512, frozenset({2}))  # tiny-llama's vocabulary and EOS


def start_simulated_stack(log_dir: Path, **spec: Any) -> Stack:
    """A stack whose executors are simulated; greedy outputs are `SIMULATED_TOKENS.generate`."""
    spec["executor_args"] = (*SIMULATED_ARGS, *spec.get("executor_args", ()))
    return start_stack(log_dir, executor_module="executor_svc.simulated", **spec)


# The shared real stack (tests/conftest.py `tiny_stack`: one per test run, for the files of
# SHARED_STACKS there): tiny-llama's random weights, a chat template, a pool small enough that
# one wide beam search cannot fit, the gateway limits those files test, and debug logs (whose
# per-request lines name each request).
TINY_STACK_BLOCKS = 200
TINY_STACK_GATEWAY_ARGS = ("--max-n", "4", "--max-num-batched-tokens", "256",
                           "--max-model-len", "1024", "--max-beam-width", "4")
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json",
               "tokenizer_config.json")


def chat_model(directory: Path) -> Path:
    """A copy of the tiny-llama preset (same name, so the same served model name) with a chat
    template, so that chat calls have something to render."""
    directory.mkdir(parents=True)
    for name in MODEL_FILES:
        shutil.copy(Path(MODEL) / name, directory / name)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return directory


def start_tiny_stack(root: Path) -> Clients:
    stack = start_stack(root, model=str(chat_model(root / "model" / "tiny-llama")),
                        executor_args=("--load-format", "dummy", "--log-level", "debug",
                                       "--num-blocks", str(TINY_STACK_BLOCKS)),
                        allocator_args=("--log-level", "debug"),
                        gateway_args=TINY_STACK_GATEWAY_ARGS)
    return Clients(stack, http=http_base(stack))


def start_stack(log_dir: Path, **spec: Any) -> Stack:
    spec.setdefault("allocator_port", 0)
    spec.setdefault("executor_port", 0)
    spec.setdefault("gateway_port", 0)
    spec.setdefault("model", MODEL)
    return Stack(StackSpec(log_dir=str(log_dir), **spec)).start()


def http_base(stack: Stack, gateway: str = "gateway") -> str:
    """The gateway's HTTP API (the launcher gives it a free port)."""
    return f"http://127.0.0.1:{stack.by_name(gateway).http_ports['--http-port']}"


@dataclass(slots=True)
class Clients:
    stack: Stack
    channels: list[grpc.Channel] = field(default_factory=list)
    http: str = ""  # the gateway's HTTP API base URL, when the test knows it

    def __post_init__(self) -> None:
        self.channels = [grpc.insecure_channel(self.stack.gateway_addr),
                         self.stack.internal_auth.channel(self.stack.allocator_addr)]

    @property
    def gateway(self) -> gpb_grpc.GatewayServiceStub:
        return gpb_grpc.GatewayServiceStub(self.channels[0])

    @property
    def allocator(self) -> apb_grpc.AllocatorServiceStub:
        return apb_grpc.AllocatorServiceStub(self.channels[1])

    def close(self) -> None:
        for channel in self.channels:
            channel.close()

    def pools(self) -> list[apb.PoolStats]:
        return list(self.allocator.GetStats(apb.GetStatsRequest()).pools)

    def wait_all_blocks_back(self, timeout_s: float = 10.0) -> list[apb.PoolStats]:
        """Every pool: no request left, no block referenced (cached free blocks are free)."""
        deadline = time.monotonic() + timeout_s
        while True:
            pools = self.pools()
            if all(p.num_requests == 0 and p.num_used_blocks == 0 for p in pools):
                return pools
            if time.monotonic() > deadline:
                raise AssertionError(f"blocks still in use: {pools}")
            time.sleep(0.1)


def wait_for(condition: Callable[[], object], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def sampling(max_tokens: int, **kwargs: Any) -> gpb.SamplingParams:
    kwargs.setdefault("temperature", 0.0)
    return gpb.SamplingParams(max_tokens=max_tokens, **kwargs)


@dataclass(slots=True)
class Streamed:
    """One completion collected from a Generate stream."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: int = 0
    usage: gpb.Usage | None = None
    num_responses: int = 0
    prompt_logprobs: list[gpb.PromptLogprob] = field(default_factory=list)


def generate(stub: gpb_grpc.GatewayServiceStub, request: gpb.GenerateRequest,
             timeout: float = 120.0,
             on_tokens: Callable[[int], None] | None = None) -> dict[int, Streamed]:
    """Collect a Generate stream; `on_tokens(n)` is told each time n tokens have arrived."""
    out: dict[int, Streamed] = {}
    for response in stub.Generate(request, timeout=timeout):
        done = out.setdefault(response.index, Streamed())
        done.token_ids.extend(response.token_ids)
        if on_tokens is not None:
            on_tokens(sum(len(s.token_ids) for s in out.values()))
        done.text += response.text
        done.num_responses += 1
        done.prompt_logprobs.extend(response.prompt_logprobs)
        if response.finish_reason:
            assert not done.finish_reason, "two final responses for one completion"
            done.finish_reason = response.finish_reason
            done.usage = response.usage
    return out


def generate_many(stub: gpb_grpc.GatewayServiceStub,
                  requests: list[gpb.GenerateRequest]) -> list[dict[int, Streamed]]:
    """Concurrent streaming clients, one thread each."""
    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        return list(pool.map(lambda r: generate(stub, r), requests))


def reference_prompt_rows(prompt: list[int]) -> torch.Tensor:
    """transformers' forward: [L - 1, V], row p the log-softmax predicting the token at p + 1."""
    with _REFERENCE_LOCK, torch.no_grad():
        logits = reference_model()(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def reference_prompt_logprobs(prompt: list[int]) -> list[float]:
    """Each prompt token's log-probability after the ones before it (reference_prompt_rows)."""
    rows = reference_prompt_rows(prompt)
    return rows.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()


@lru_cache(maxsize=1)
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(MODEL)


# Streaming clients check their outputs from several threads: one reference at a time. Two
# threads building the model at once drew its seeded weights from one global RNG in turns,
# and the reference came out wrong.
_REFERENCE_LOCK = threading.RLock()


@lru_cache(maxsize=1)
def reference_model() -> Any:
    """The executor's dummy weights, rebuilt the same way (seeded init from the config)."""
    with _REFERENCE_LOCK:
        return _build_reference_model()


def _build_reference_model() -> Any:
    config = AutoConfig.from_pretrained(MODEL, local_files_only=True)
    model = dummy_model(config, torch.float32, DUMMY_SEED, attn_implementation="eager")
    model.generation_config.eos_token_id = None  # per call: see reference_greedy
    return model.eval()


@lru_cache(maxsize=256)
def reference_greedy(
    prompt: tuple[int, ...], max_tokens: int, ignore_eos: bool = False
) -> tuple[int, ...]:
    """transformers' own greedy generate: the oracle (stops after EOS unless ignore_eos)."""
    with _REFERENCE_LOCK:
        model = reference_model()
    config = GenerationConfig(
        max_new_tokens=max_tokens, do_sample=False, pad_token_id=0, bos_token_id=1,
        eos_token_id=None if ignore_eos else 2,
    )
    with _REFERENCE_LOCK, torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=config)
    return tuple(int(t) for t in out[0, len(prompt):])


def reference_constrained_greedy(prompt: list[int], constraint: StructuredOutput,
                                 max_tokens: int) -> tuple[int, ...]:
    """Greedy under a structured-output constraint on the executor's dummy weights (EOS
    included when the output completes)."""
    def next_logits(tokens: list[int]) -> torch.Tensor:
        with _REFERENCE_LOCK, torch.no_grad():
            return reference_model()(torch.tensor([tokens])).logits[0, -1]

    vocab_size = AutoConfig.from_pretrained(MODEL, local_files_only=True).vocab_size
    return tuple(reference_constrained(next_logits, prompt, MODEL, vocab_size, (EOS,),
                                       constraint, max_tokens))


def prompts(num: int, length: int, seed: int = 0) -> Iterator[list[int]]:
    """Deterministic prompts of token ids (BOS first), distinct from each other."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(num):
        body = torch.randint(3, 500, (length - 1,), generator=gen).tolist()
        yield [1, *body]


# Beam search (tests/e2e/test_beam_search_stack.py, test_preemption.py).
EOS = 2
EARLY = {False: gpb.EARLY_STOPPING_HEURISTIC, True: gpb.EARLY_STOPPING_WHEN_FULL,
         "never": gpb.EARLY_STOPPING_NEVER}


def reference_beams(prompt: list[int], width: int, n: int, max_tokens: int,
                    length_penalty: float, early: bool | str, stops: tuple[int, ...] = (EOS,)
                    ) -> list[tuple[int, ...]]:
    """transformers' beam search on the executor's dummy weights: the n best, in order, each
    cut after its stop token (transformers pads the shorter ones)."""
    config = GenerationConfig(
        max_new_tokens=max_tokens, do_sample=False, num_beams=width, num_return_sequences=n,
        length_penalty=length_penalty, early_stopping=early, pad_token_id=0, bos_token_id=1,
        eos_token_id=list(stops))
    with torch.no_grad():
        out = reference_model().generate(torch.tensor([prompt]), generation_config=config)
    hypotheses = []
    for row in out[:, len(prompt):].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        hypotheses.append(tuple(row[:end]))
    return hypotheses


def beam_request(prompt: list[int], width: int, n: int, max_tokens: int,
                 length_penalty: float = 1.0, early: bool | str = False,
                 stop_token_ids: tuple[int, ...] = ()) -> gpb.GenerateRequest:
    return gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=prompt), sampling=gpb.SamplingParams(
        max_tokens=max_tokens, n=n, use_beam_search=True, beam_width=width,
        length_penalty=length_penalty, early_stopping=EARLY[early],
        stop_token_ids=stop_token_ids))
