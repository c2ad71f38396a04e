"""The baselines users would pick instead: transformers `generate` and its continuous batching.

Both run in this process on the executor's exact dummy weights (the executor's recipe:
`torch.manual_seed(seed)` then `AutoModelForCausalLM.from_config(config)`), fp32, greedy, with
a fixed number of torch threads. Each returns one `RequestResult` per request (token ids and
the times its first and last own token appeared) so the serving benchmark reports the three
systems with the same statistics.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(slots=True)
class BenchRequest:
    prompt: list[int]
    output_len: int
    arrival_s: float = 0.0  # open loop: offset from the start of the run
    model: str = ""  # a LoRA adapter's name ("": the base model)
    temperature: float = 0.0  # > 0: sampled, seeded by `seed`
    seed: int = 0


@dataclass(slots=True)
class RequestResult:
    """Times are seconds from the start of the run."""

    tokens: list[int] = field(default_factory=list)
    sent_s: float = 0.0
    first_s: float = 0.0
    last_s: float = 0.0
    ok: bool = True
    error: str = ""

    @property
    def ttft_s(self) -> float:
        return self.first_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        n = len(self.tokens)
        return (self.last_s - self.first_s) / (n - 1) if n > 1 else None


def reference_model(model_dir: str, seed: int = 0, attn: str = "sdpa",
                    dtype: torch.dtype = torch.float32) -> Any:
    """The executor's dummy weights, rebuilt exactly as `--load-format dummy --seed` does."""
    from transformers import AutoConfig

    from executor_svc.model_loader import dummy_model

    config = AutoConfig.from_pretrained(str(REPO_ROOT / model_dir), local_files_only=True)
    model = dummy_model(config, dtype, seed, attn_implementation=attn)  # on the CPU
    model.requires_grad_(False)
    model.generation_config.eos_token_id = None
    return model.eval()


def _gen_config(max_new_tokens: int, **extra: Any) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                            bos_token_id=1, eos_token_id=None, **extra)


class _StepClock:
    """A stopping criterion that never stops: it timestamps every decoding step."""

    def __init__(self, origin: float) -> None:
        self.origin = origin
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        self.times.append(time.perf_counter() - self.origin)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def run_generate(model: Any, requests: Sequence[BenchRequest], batch_size: int
                 ) -> tuple[list[RequestResult], float]:
    """Static batches in arrival order: left padding, each batch runs to its longest output;
    only each request's own tokens count. Returns (results, wall seconds)."""
    from transformers import StoppingCriteriaList

    results: list[RequestResult] = []
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        width = max(len(r.prompt) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt):] = torch.tensor(r.prompt)
            mask[row, width - len(r.prompt):] = 1
        longest = max(r.output_len for r in batch)
        sent = time.perf_counter() - start
        clock = _StepClock(start)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask,
                                 generation_config=_gen_config(longest),
                                 stopping_criteria=StoppingCriteriaList([clock]))
        for row, r in enumerate(batch):
            own = out[row, width:width + r.output_len].tolist()
            results.append(RequestResult(tokens=own, sent_s=sent, first_s=clock.times[0],
                                         last_s=clock.times[r.output_len - 1]))
    return results, time.perf_counter() - start


def cb_config(num_blocks: int, max_batch_tokens: int, page_size: int = 16,
              max_requests: int | None = None) -> Any:
    """transformers' ContinuousBatchingConfig from the fields this version has."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    names = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    wanted: dict[str, Any] = {"num_blocks": num_blocks, "max_batch_tokens": max_batch_tokens}
    wanted["page_size" if "page_size" in names else "block_size"] = page_size
    if max_requests is not None and "max_requests_per_batch" in names:
        wanted["max_requests_per_batch"] = max_requests
    return ContinuousBatchingConfig(**{k: v for k, v in wanted.items() if k in names})


def run_continuous(model: Any, requests: Sequence[BenchRequest], concurrency: int | None,
                   num_blocks: int = 4096, max_batch_tokens: int = 2048,
                   open_loop: bool = False) -> tuple[list[RequestResult], float]:
    """transformers' continuous batching, per-request max_new_tokens, EOS off.

    Closed loop: `concurrency` requests in flight, the next added when one finishes. Open loop:
    each request is added at its arrival time. Streaming outputs give the first-token time.
    """
    generation_config = _gen_config(max(r.output_len for r in requests))
    config = cb_config(num_blocks, max_batch_tokens)
    results = [RequestResult() for _ in requests]
    firsts: dict[str, float] = {}
    done: queue.Queue[str] = queue.Queue()
    with model.continuous_batching_context_manager(
        generation_config=generation_config, continuous_batching_config=config,
        block=True, timeout=30,
    ) as manager:
        start = time.perf_counter()
        stop_reader = threading.Event()

        def reader() -> None:
            while not stop_reader.is_set():
                out = manager.get_result(timeout=0.05)
                if out is None:
                    continue
                now = time.perf_counter() - start
                if out.request_id not in firsts and out.generated_tokens:
                    firsts[out.request_id] = now
                if out.is_finished():
                    index = int(out.request_id.removeprefix("b"))
                    res = results[index]
                    res.tokens = list(out.generated_tokens)
                    res.first_s = firsts.get(out.request_id, now)
                    res.last_s = now
                    res.ok = out.error is None
                    res.error = out.error or ""
                    done.put(out.request_id)

        thread = threading.Thread(target=reader, daemon=True)
        thread.start()

        def add(index: int) -> None:
            r = requests[index]
            results[index].sent_s = time.perf_counter() - start
            manager.add_request(r.prompt, request_id=f"b{index}", max_new_tokens=r.output_len,
                                streaming=True, eos_token_id=-1)

        if open_loop:
            for index, r in enumerate(requests):
                delay = r.arrival_s - (time.perf_counter() - start)
                if delay > 0:
                    time.sleep(delay)
                add(index)
            for _ in requests:
                done.get(timeout=600)
        else:
            width = concurrency or len(requests)
            next_index = 0
            while next_index < min(width, len(requests)):
                add(next_index)
                next_index += 1
            for _ in requests:
                done.get(timeout=600)
                if next_index < len(requests):
                    add(next_index)
                    next_index += 1
        wall = time.perf_counter() - start
        stop_reader.set()
        thread.join(5)
    return results, wall


def oracle_greedy(model: Any, prompt: list[int], output_len: int) -> list[int]:
    """One request alone, no padding: what every system should produce."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), generation_config=_gen_config(output_len))
    return out[0, len(prompt):].tolist()
