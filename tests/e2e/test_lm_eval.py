"""lm-evaluation-harness against the HTTP API, on a task defined in this repository
(tests/e2e/lm_eval_tasks: a loglikelihood task and a generation task, JSONL data): its
`local-completions` model (echo + logprobs for loglikelihoods, token-id prompts) and its
`local-chat-completions` model score exactly what lm-eval's own `hf` model scores on the
same task and weights (the embedded SmolLM2, float32): equal metrics, every loglikelihood
within float32 tolerance, every generation identical.

Marked `lmeval`, which `make test` deselects: `make lmeval-e2e` builds lm-eval's virtualenv
(pinned, with torch at the CPU pin for its `hf` model) and runs these with
PAGEDKV_LMEVAL_REQUIRED=1, where a missing virtualenv fails instead of skipping.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_stack import ROOT, http_base, start_stack

from common.model_dirs import DEFAULT_MODEL

pytestmark = pytest.mark.lmeval

TASKS = ROOT / "tests" / "e2e" / "lm_eval_tasks"
SERVED = "SmolLM2-135M-Instruct"  # the gateway's default served name for the model
REQUIRED = os.environ.get("PAGEDKV_LMEVAL_REQUIRED") == "1"
LM_EVAL = ROOT / ".venv-lmeval" / "bin" / "lm_eval"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "OPENAI_API_KEY": "unused"}
RUN_TIMEOUT_S = 900
LOGLIKELIHOOD_TOLERANCE = 1e-3  # a continuation's summed float32 logprobs, two engines


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if not LM_EVAL.exists():
        message = f"{LM_EVAL} is missing: run `make lmeval-e2e` (it builds .venv-lmeval)"
        if REQUIRED:
            pytest.fail(message)
        pytest.skip(message)
    if not any(DEFAULT_MODEL.glob("*.safetensors")):
        pytest.fail(f"{DEFAULT_MODEL} has no weights: run `make setup`")
    stack = start_stack(tmp_path_factory.mktemp("stack"), model=str(DEFAULT_MODEL),
                        executor_args=("--dtype", "float32"))
    yield http_base(stack)
    stack.stop()


def lm_eval(out: Path, model: str, model_args: dict[str, object], tasks: str,
            *extra: str) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """One lm_eval run: its results' metrics by task, and its logged samples by task."""
    args = ",".join(f"{k}={v}" for k, v in model_args.items())
    argv = [str(LM_EVAL), "--model", model, "--model_args", args, "--tasks", tasks,
            "--include_path", str(TASKS), "--batch_size", "1", "--output_path", str(out),
            "--log_samples", "--seed", "1234", *extra]
    log = out.with_suffix(".log")
    with log.open("w") as sink:
        done = subprocess.run(argv, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT,
                              env={**os.environ, **OFFLINE,
                                   "HF_DATASETS_CACHE": str(out / "datasets")},
                              timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, f"lm_eval exited {done.returncode}:\n{log.read_text()[-4000:]}"
    (results_file,) = out.rglob("results_*.json")
    results = json.loads(results_file.read_text())["results"]
    samples = {}
    for task in tasks.split(","):
        (samples_file,) = out.rglob(f"samples_{task}_*.jsonl")
        lines = samples_file.read_text().splitlines()
        samples[task] = sorted((json.loads(line) for line in lines), key=lambda s: s["doc_id"])
    return results, samples


def _hf(out: Path, tasks: str, *extra: str) -> tuple[dict[str, Any], dict[str, list[dict]]]:
    return lm_eval(out, "hf", {"pretrained": DEFAULT_MODEL, "dtype": "float32"}, tasks,
                   "--device", "cpu", *extra)


def _metrics(results: dict[str, Any], task: str) -> dict[str, float]:
    return {k: v for k, v in results[task].items()
            if k.split(",")[0] in ("acc", "acc_norm", "exact_match")}


def test_local_completions_scores_what_the_hf_model_scores(base: str, tmp_path: Path):
    tasks = "pagedkv_choice,pagedkv_generate"
    api_results, api_samples = lm_eval(tmp_path / "api", "local-completions", {
        "model": SERVED, "base_url": f"{base}/v1/completions", "tokenizer": DEFAULT_MODEL,
        "tokenizer_backend": "huggingface", "tokenized_requests": True, "num_concurrent": 4,
        "max_retries": 1}, tasks)
    hf_results, hf_samples = _hf(tmp_path / "hf", tasks)
    for task in tasks.split(","):
        assert _metrics(api_results, task) == _metrics(hf_results, task), task
    choices = list(zip(api_samples["pagedkv_choice"], hf_samples["pagedkv_choice"], strict=True))
    assert len(choices) == 12
    for api, hf in choices:  # each choice's (loglikelihood, is_greedy)
        for (api_ll, api_greedy), (hf_ll, hf_greedy) in zip(
                (r[0] for r in api["resps"]), (r[0] for r in hf["resps"]), strict=True):
            assert abs(float(api_ll) - float(hf_ll)) <= LOGLIKELIHOOD_TOLERANCE, (api, hf)
            assert api_greedy == hf_greedy
    generated = [(a["resps"], h["resps"]) for a, h in zip(
        api_samples["pagedkv_generate"], hf_samples["pagedkv_generate"], strict=True)]
    assert len(generated) == 8 and all(a == h for a, h in generated), generated
    assert any(a != [[""]] for a, _ in generated)  # (some answer is more than a newline)
    assert _metrics(api_results, "pagedkv_choice")["acc,none"] > 0.5  # (the model knows some)


def test_local_chat_completions_generates_what_the_hf_model_generates(base: str,
                                                                      tmp_path: Path):
    api_results, api_samples = lm_eval(tmp_path / "api", "local-chat-completions", {
        "model": SERVED, "base_url": f"{base}/v1/chat/completions", "num_concurrent": 4,
        "max_retries": 1}, "pagedkv_generate", "--apply_chat_template")
    hf_results, hf_samples = _hf(tmp_path / "hf", "pagedkv_generate", "--apply_chat_template")
    assert _metrics(api_results, "pagedkv_generate") == _metrics(hf_results, "pagedkv_generate")
    generated = [(a["resps"], h["resps"]) for a, h in zip(
        api_samples["pagedkv_generate"], hf_samples["pagedkv_generate"], strict=True)]
    assert len(generated) == 8 and all(a == h for a, h in generated), generated
    assert _metrics(api_results, "pagedkv_generate")["exact_match,strip"] > 0
