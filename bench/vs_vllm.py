"""pagedkv (all three services) against vLLM's own CPU engine, same model, same requests.

    make bench-vllm                         # creates .venv-vllm once, then runs this
    .venv/bin/python -m bench.vs_vllm [--quick] [--repeats N] [--skip-online]

Model: the embedded SmolLM2-135M-Instruct (fp32, real weights), greedy, fixed output lengths
(ignore_eos), 64 requests submitted at once. Workloads (seeded; prompt ids uniform in
[17, 49152), below which SmolLM2's special tokens sit; each repeat draws fresh requests, the
same for both systems, so no repeat is served from the other's prefix cache):
  mixed  prompts log-normal, median 96, sigma 0.6, clipped to 16..512; outputs log-normal,
         median 48, sigma 0.6, clipped to 8..256
  equal  128 prompt tokens -> 64 new for every request

Throughput (interleaved: each system goes first in turn, one repeat each; medians), for each
dtype in --dtypes (float32, the default of both; bfloat16, an option of both):
  vllm     vLLM CPU's offline `LLM.generate` on all 64 requests, in its own virtualenv, in
           its best configuration measured here: OpenMP threads bound to both cores
           (VLLM_CPU_OMP_THREADS_BIND=0-1; its default binding keeps one core for its engine
           process and ran 0.57x as fast on the equal workload), tcmalloc and Intel OpenMP
           preloaded (its docs' advice; 1.05x here).
  pagedkv  `make run`'s stack (gateway + allocator + executor as subprocesses, defaults;
           `--dtype bfloat16` on the executor for the bf16 rows) with 64 concurrent gRPC
           calls from this process: unary `Complete` (each output whole at its end, as
           `LLM.generate` returns them), and, as `pagedkv_stream`, streaming `Generate` (one
           message per request and step: CPU the executor's two threads lose, ~5% here).
Output tok/s = all output tokens / wall time. Agreement = requests whose first 16 tokens
(and whose whole output) are identical between the two engines.

Latency at concurrency 1, 16 and 64 (closed loop, mixed requests): TTFT and inter-token
latency ((last - first token) / (n - 1) per request), medians; vLLM through its
OpenAI-compatible server (`vllm.entrypoints.openai.api_server`), pagedkv through its gRPC
streaming API (it has no HTTP API yet).

Writes bench/results/vs_vllm.json and vs_vllm.png.

Latency runs in float32 only; the server gets the same environment as the offline engine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.baselines import BenchRequest, RequestResult
from bench.common import RESULTS_DIR, machine, markdown_table, percentile, write_results
from bench.load import run_load, stack
from bench.workloads import bounded_lognormal
from common.model_dirs import DEFAULT_MODEL, REPO_ROOT

VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
WORKER = Path(__file__).resolve().parent / "vllm_worker.py"
DONE_MARKER = "PAGEDKV_VLLM_DONE"
# vLLM's worker busy-polls its shared-memory queue for 1 s after its last read
# (vllm/distributed/device_communicators/shm_broadcast.py, SpinCondition.busy_loop_s): a whole
# core, taken from whatever is measured next. Each offline call waits it out before returning.
VLLM_BUSY_LOOP_S = 1.5
VOCAB, FIRST_ID = 49152, 17
AGREEMENT_PREFIX = 16
REQUESTS_PER_RUN = 64
SYSTEMS = ("vllm", "pagedkv")  # latency: both streaming
# Throughput: pagedkv's unary Complete (each whole output at once, as LLM.generate returns
# them) and its streaming Generate (one message per request and step besides).
THROUGHPUT_SYSTEMS = ("vllm", "pagedkv", "pagedkv_stream")
# Libraries vLLM's CPU docs ask to preload; used where this machine has them.
PRELOAD_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    str(REPO_ROOT / ".venv-vllm" / "lib" / "libiomp5.so"),
)


def mixed_requests(count: int, seed: int = 0) -> list[BenchRequest]:
    rng = random.Random(f"mixed-{seed}")
    out = []
    for _ in range(count):
        prompt_len = bounded_lognormal(rng, 96, 0.6, 16, 512)
        output_len = bounded_lognormal(rng, 48, 0.6, 8, 256)
        out.append(BenchRequest([rng.randrange(FIRST_ID, VOCAB) for _ in range(prompt_len)],
                                output_len))
    return out


def equal_requests(count: int, seed: int = 0) -> list[BenchRequest]:
    rng = random.Random(f"equal-{seed}")
    return [BenchRequest([rng.randrange(FIRST_ID, VOCAB) for _ in range(128)], 64)
            for _ in range(count)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def vllm_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
    preload = [p for p in PRELOAD_CANDIDATES if Path(p).exists()]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


class VllmOffline:
    """One resident `LLM` in vLLM's interpreter; `generate` sends it one batch."""

    def __init__(self, model: str, dtype: str, log_path: Path) -> None:
        self.log = log_path.open("w")
        self.process = subprocess.Popen(
            [str(VLLM_PYTHON), str(WORKER), "offline", "--model", model, "--dtype", dtype],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
            env=vllm_env(), cwd=REPO_ROOT,
        )
        self._wait_done()

    def _wait_done(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.strip() == DONE_MARKER:
                return
        raise RuntimeError(f"vLLM worker exited ({self.process.wait()}); see {self.log.name}")

    def generate(self, requests: list[BenchRequest]) -> tuple[list[list[int]], float]:
        assert self.process.stdin is not None
        with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
            command = {"requests": [[r.prompt, r.output_len] for r in requests],
                       "out": out.name}
            self.process.stdin.write(json.dumps(command) + "\n")
            self.process.stdin.flush()
            self._wait_done()
            result = json.loads(Path(out.name).read_text())
        time.sleep(VLLM_BUSY_LOOP_S)  # not timed: wall_s is the worker's own
        return result["outputs"], result["wall_s"]

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def vllm_missing() -> bool:
    """vLLM CPU's virtualenv is not there (said on stderr, with how to make it)."""
    if VLLM_PYTHON.exists():
        return False
    print("vLLM CPU's virtualenv is missing: run `make bench-vllm` (it creates .venv-vllm)",
          file=sys.stderr)
    return True


@contextmanager
def vllm_server(model: str, log_path: Path, dtype: str = "float32",
                served_name: str | None = None, extra_args: tuple[str, ...] = ()
                ) -> Iterator[str]:
    port = _free_port()
    named = ("--served-model-name", served_name, *extra_args) if served_name else extra_args
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
             "--dtype", dtype, "--max-model-len", "2048", "--seed", "0",
             "--kv-cache-memory-bytes", str(2 << 30), "--host", "127.0.0.1",
             "--port", str(port), *named],
            stdout=log, stderr=subprocess.STDOUT, env=vllm_env(), cwd=REPO_ROOT,
            start_new_session=True,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 600
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"vLLM server exited; see {log_path}")
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                        if response.status == 200:
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vLLM server not up after 600 s; see {log_path}")
                time.sleep(1)
            yield f"{url}/v1"
        finally:
            process.terminate()
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()


def vllm_online(url: str, requests: list[BenchRequest], concurrency: int) -> list[RequestResult]:
    with tempfile.TemporaryDirectory() as tmp:
        req_path, out_path = Path(tmp) / "requests.json", Path(tmp) / "out.json"
        req_path.write_text(json.dumps([[r.prompt, r.output_len] for r in requests]))
        subprocess.run([str(VLLM_PYTHON), str(WORKER), "client", "--url", url, "--requests",
                        str(req_path), "--concurrency", str(concurrency), "--out",
                        str(out_path)], check=True, cwd=REPO_ROOT, env=vllm_env())
        records = json.loads(out_path.read_text())["records"]
    results = []
    for record in records:
        times = record["times"]
        results.append(RequestResult(tokens=[0] * len(times), sent_s=record["sent_s"],
                                     first_s=times[0] if times else 0.0,
                                     last_s=times[-1] if times else 0.0, ok=bool(times)))
    return results


def latency_summary(results: list[RequestResult], wall_s: float | None = None
                    ) -> dict[str, float]:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s * 1e3 for r in ok]
    itl = [t * 1e3 for r in ok if (t := r.tpot_s) is not None]
    out = {"completed": len(ok), "requests": len(results),
           "ttft_p50_ms": percentile(ttft, 50) if ttft else float("nan"),
           "ttft_p99_ms": percentile(ttft, 99) if ttft else float("nan"),
           "itl_p50_ms": percentile(itl, 50) if itl else float("nan"),
           "itl_p99_ms": percentile(itl, 99) if itl else float("nan")}
    if wall_s is not None:
        out["tok_per_s"] = sum(len(r.tokens) for r in ok) / wall_s
    return out


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, int]:
    pairs = list(zip(a, b, strict=True))
    return {"prefix16": sum(x[:AGREEMENT_PREFIX] == y[:AGREEMENT_PREFIX] for x, y in pairs),
            "full": sum(x == y for x, y in pairs), "requests": len(a)}


def throughput(workloads: dict[str, Callable[[int, int], list[BenchRequest]]], repeats: int,
               vllm: VllmOffline, gateway_addr: str, dtype: str) -> list[dict[str, Any]]:
    rows = []
    for name, make_requests in workloads.items():
        rates: dict[str, list[float]] = {s: [] for s in THROUGHPUT_SYSTEMS}
        outputs: dict[str, list[list[int]]] = {s: [] for s in THROUGHPUT_SYSTEMS}
        prompt_tokens = output_tokens = 0
        for rep in range(repeats):
            # Fresh prompts every repeat (the same for both systems): with the first repeat's
            # prompts again, both engines' prefix caches would skip every prefill after it.
            requests = make_requests(REQUESTS_PER_RUN, rep)
            prompt_tokens += sum(len(r.prompt) for r in requests)
            output_tokens += sum(r.output_len for r in requests)
            turn = rep % len(THROUGHPUT_SYSTEMS)  # each system first in turn
            order = THROUGHPUT_SYSTEMS[turn:] + THROUGHPUT_SYSTEMS[:turn]
            for system in order:
                print(f"[vs_vllm] {dtype} {name} rep {rep + 1}/{repeats}: {system}",
                      file=sys.stderr, flush=True)
                if system == "vllm":
                    outs, wall = vllm.generate(requests)
                else:
                    # Both pagedkv runs serve the same prompts: a salt of their own keeps
                    # the second from hitting the first's prefix cache.
                    results, wall = run_load(gateway_addr, requests, concurrency=len(requests),
                                             unary=system == "pagedkv", salt=f"{system}-{rep}")
                    failed = [r.error for r in results if not r.ok]
                    if failed:
                        raise RuntimeError(f"pagedkv: {len(failed)} failed, e.g. {failed[0]}")
                    outs = [r.tokens for r in results]
                expected = [r.output_len for r in requests]
                assert [len(o) for o in outs] == expected, f"{system}: wrong output lengths"
                rates[system].append(sum(expected) / wall)
                outputs[system] += outs
        medians = {s: statistics.median(v) for s, v in rates.items()}
        rows.append({
            "workload": name, "dtype": dtype, "num_requests": REQUESTS_PER_RUN,
            "repeats": repeats, "prompt_tokens": prompt_tokens // repeats,
            "output_tokens": output_tokens // repeats,
            "tok_per_s": medians, "samples": rates,
            "ratio": medians["pagedkv"] / medians["vllm"],
            "ratio_stream": medians["pagedkv_stream"] / medians["vllm"],
            "agreement": agreement(outputs["vllm"], outputs["pagedkv"]),
            "stream_equals_unary": outputs["pagedkv_stream"] == outputs["pagedkv"],
        })
        print(f"[vs_vllm] {dtype} {name}: vllm {medians['vllm']:.0f} tok/s, pagedkv "
              f"{medians['pagedkv']:.0f} tok/s ({rows[-1]['ratio']:.2f}x), streamed "
              f"{medians['pagedkv_stream']:.0f} ({rows[-1]['ratio_stream']:.2f}x)",
              file=sys.stderr, flush=True)
    return rows


def latency(levels: list[tuple[int, int]], gateway_addr: str, vllm_url: str
            ) -> list[dict[str, Any]]:
    rows = []
    for concurrency, count in levels:
        requests = mixed_requests(count, seed=100 + concurrency)
        row: dict[str, Any] = {"concurrency": concurrency, "num_requests": count}
        for system in SYSTEMS:
            print(f"[vs_vllm] latency c={concurrency}: {system}", file=sys.stderr, flush=True)
            if system == "vllm":
                row[system] = latency_summary(vllm_online(vllm_url, requests, concurrency))
            else:
                results, wall = run_load(gateway_addr, requests, concurrency=concurrency)
                row[system] = latency_summary(results)
        rows.append(row)
    return rows


def render(rows: list[dict[str, Any]], latency_rows: list[dict[str, Any]]) -> str:
    out = ["### Throughput: 64 requests at once, SmolLM2-135M-Instruct, CPU", "",
           markdown_table(
               ["workload", "dtype", "vLLM CPU tok/s", "pagedkv tok/s (Complete)",
                "pagedkv / vLLM", "pagedkv tok/s (Generate, streamed)", "streamed / vLLM",
                "first 16 tokens agree", "whole outputs agree"],
               [[r["workload"], r["dtype"], f"{r['tok_per_s']['vllm']:.0f}",
                 f"{r['tok_per_s']['pagedkv']:.0f}", f"{r['ratio']:.2f}x",
                 f"{r['tok_per_s']['pagedkv_stream']:.0f}", f"{r['ratio_stream']:.2f}x",
                 f"{r['agreement']['prefix16']}/{r['agreement']['requests']}",
                 f"{r['agreement']['full']}/{r['agreement']['requests']}"] for r in rows]), ""]
    if latency_rows:
        body = []
        for r in latency_rows:
            for system in SYSTEMS:
                m = r[system]
                body.append([r["concurrency"], system, f"{m['ttft_p50_ms']:.0f}",
                             f"{m['ttft_p99_ms']:.0f}", f"{m['itl_p50_ms']:.1f}",
                             f"{m['itl_p99_ms']:.1f}", f"{m['completed']}/{m['requests']}"])
        out += ["### Latency (mixed requests, closed loop)", "",
                markdown_table(["concurrency", "system", "TTFT p50 ms", "TTFT p99 ms",
                                "ITL p50 ms", "ITL p99 ms", "done"], body), ""]
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], latency_rows: list[dict[str, Any]], path: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    names = [f"{r['workload']}\n{r['dtype']}" for r in rows]
    width = 0.8 / len(THROUGHPUT_SYSTEMS)
    for k, system in enumerate(THROUGHPUT_SYSTEMS):
        axes[0].bar([i + width * k for i in range(len(rows))],
                    [r["tok_per_s"][system] for r in rows], width=width, label=system)
    axes[0].set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], names)
    axes[0].set_title("output tokens/s (64 requests)")
    axes[0].legend()
    for system in SYSTEMS:
        xs = [r["concurrency"] for r in latency_rows]
        axes[1].plot(xs, [r[system]["ttft_p50_ms"] for r in latency_rows], marker="o",
                     label=system)
        axes[2].plot(xs, [r[system]["itl_p50_ms"] for r in latency_rows], marker="o",
                     label=system)
    for ax, title in ((axes[1], "TTFT p50 (ms)"), (axes[2], "inter-token latency p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("SmolLM2-135M-Instruct on CPU (2 cores): pagedkv vs vLLM CPU (latency: fp32)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.vs_vllm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one repeat, smaller latency runs")
    p.add_argument("--repeats", type=int, default=None, help="default: 1 quick, 3 full")
    p.add_argument("--skip-online", action="store_true", help="throughput only")
    p.add_argument("--dtypes", default="float32,bfloat16",
                   help="comma-separated: float32 (both engines' default), bfloat16")
    p.add_argument("--name", default="vs_vllm", help="bench/results/<name>.json and .png")
    args = p.parse_args(argv)
    if not VLLM_PYTHON.exists():
        print("vLLM CPU's virtualenv is missing: run `make bench-vllm` (it creates "
              ".venv-vllm)", file=sys.stderr)
        return 2
    if not DEFAULT_MODEL.is_dir():
        print("the embedded model is missing: run `make setup`", file=sys.stderr)
        return 2
    repeats = args.repeats or (1 if args.quick else 3)
    workloads = {"mixed": mixed_requests, "equal": equal_requests}
    levels = [(1, 4), (16, 32), (64, 64)] if args.quick else [(1, 8), (16, 48), (64, 128)]
    log_dir = Path(tempfile.mkdtemp(prefix="pagedkv-vs-vllm-"))
    load_before = os.getloadavg()
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    latency_rows: list[dict[str, Any]] = []
    for dtype in args.dtypes.split(","):
        # `make run`'s stack (defaults, embedded model, its own weights) on free ports.
        (log_dir / dtype).mkdir(parents=True)
        with stack(str(DEFAULT_MODEL), executor_args=("--dtype", dtype), load_format="auto",
                   log_dir=str(log_dir / dtype)) as running:
            addr = running.gateway_addr
            run_load(addr, mixed_requests(16, seed=99), concurrency=16)  # warm-up, as vLLM's
            vllm = VllmOffline(str(DEFAULT_MODEL), dtype, log_dir / f"vllm-offline-{dtype}.log")
            try:
                vllm.generate(mixed_requests(16, seed=99))  # warm-up (compiled graphs, buffers)
                rows += throughput(workloads, repeats, vllm, addr, dtype)
            finally:
                vllm.close()
            if dtype == "float32" and not args.skip_online:
                with vllm_server(str(DEFAULT_MODEL), log_dir / "vllm-server.log") as url:
                    vllm_online(url, mixed_requests(4, seed=98), 4)  # warm-up
                    latency_rows = latency(levels, addr, url)
    table = render(rows, latency_rows)
    print(table)
    payload = {
        "benchmark": "vs_vllm", "model": DEFAULT_MODEL.name, "dtype": args.dtypes,
        "repeats": repeats, "quick": args.quick, "machine": machine(),
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
        "vllm_env": {k: vllm_env().get(k, "") for k in ("LD_PRELOAD",
                                                          "VLLM_CPU_OMP_THREADS_BIND")},
        "workloads": {"mixed": "64 requests; prompt LN(median 96, sigma 0.6) in [16, 512]; "
                               "output LN(median 48, sigma 0.6) in [8, 256]",
                      "equal": "64 requests; 128 -> 64"},
        "throughput": rows, "latency": latency_rows,
        "elapsed_s": time.perf_counter() - started, "logs": str(log_dir),
    }
    write_results(args.name, payload)
    payload["plot"] = plot(rows, latency_rows, RESULTS_DIR / f"{args.name}.png")
    write_results(args.name, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
