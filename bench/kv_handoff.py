"""KV hand-off between two executors on loopback: how long ImportKV takes to move a request's
KV, block by block, from the executor that prefilled it.

    python -m bench.kv_handoff [--model smollm2|tiny|DIR] [--lengths 16,64,...] [--repeats 5]

Two `python -m executor_svc` processes (role tokens between them, as deployed); the
source prefills one request per length, the target imports its KV `--repeats` times into the
same blocks (ExecutorClient.import_kv, the gateway's call). Reported per length, medians: the
target's own elapsed_ms (from its ImportKV's start to the last block written), the caller's
round trip, ms per block and MB/s. Writes bench/results/kv_handoff.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import markdown_table, median, write_results
from common.credentials import InternalAuth, RoleTokens
from gateway.clients.executor_client import ExecutorClient
from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.executor.v1 import executor_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"smollm2": ROOT / "models" / "smollm2-135m-instruct",
          "tiny": ROOT / "models" / "tiny-llama"}
LENGTHS = (16, 64, 256, 1024, 2048)


def _model_dir(choice: str) -> Path:
    path = MODELS.get(choice, Path(choice))
    if choice == "smollm2" and not any(path.glob("*.safetensors")):
        print(f"kv_handoff: {path} has no weights (make setup); using the tiny preset",
              file=sys.stderr)
        return MODELS["tiny"]
    return path


def _start(model: Path, workdir: Path, name: str, num_blocks: int, tokens: RoleTokens
           ) -> tuple[subprocess.Popen[bytes], Path]:
    port_file, log_path = workdir / f"{name}.port", workdir / f"{name}.log"
    weights = "auto" if any(model.glob("*.safetensors")) else "dummy"
    command = [sys.executable, "-m", "executor_svc", "--model", str(model), "--load-format",
               weights, "--dtype", "float32", "--num-blocks", str(num_blocks), "--swap-space", "0",
               "--port", "0",
               "--port-file", str(port_file), "--metrics-port", "-1", "--log-level", "warning"]
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, **tokens.env("executor")})
    return process, port_file


def _wait(process: subprocess.Popen[bytes], port_file: Path) -> str:
    deadline = time.monotonic() + 300
    while not port_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"an executor did not start; see {port_file.with_suffix('.log')}")
        time.sleep(0.1)
    return f"127.0.0.1:{port_file.read_text().strip()}"


def _prefill(stub: pb_grpc.ExecutorServiceStub, rid: str, num_tokens: int, block_size: int,
             vocab_size: int) -> None:
    tokens = [3 + (i * 7919) % (vocab_size - 3) for i in range(num_tokens)]
    blocks = list(range(-(-num_tokens // block_size)))
    stub.Execute(pb.ExecuteRequest(seqs=[pb.SequenceWork(
        request_id=rid, token_ids=tokens, sampling=pb.SamplingParams(), sample=True,
        delta=pb.BlockTableDelta(start_index=0, block_ids=blocks))]), timeout=600)


async def _imports(target: str, source: str, rid: str, num_blocks: int, num_tokens: int,
                   auth: InternalAuth, repeats: int) -> list[tuple[float, float, int]]:
    """(target's elapsed_ms, caller's round trip ms, bytes) per repeat."""
    client = ExecutorClient(target, auth)
    try:
        samples = []
        for _ in range(repeats):
            began = time.perf_counter()
            moved = await client.import_kv(source, rid, 0, list(range(num_blocks)), num_tokens,
                                           timeout=600)
            samples.append((moved.elapsed_ms, (time.perf_counter() - began) * 1e3,
                            moved.num_bytes))
        return samples
    finally:
        await client.close()


def run(model: Path, lengths: list[int], repeats: int) -> dict[str, Any]:
    tokens = RoleTokens.new()
    auth = tokens.auth("gateway")
    num_blocks = -(-max(lengths) // 16) + 8
    with tempfile.TemporaryDirectory() as tmp:
        started = [_start(model, Path(tmp), name, num_blocks, tokens)
                   for name in ("source", "target")]
        try:
            source, target = (_wait(p, f) for p, f in started)
            channel = auth.channel(source)
            stub = pb_grpc.ExecutorServiceStub(channel)
            info = stub.Describe(pb.DescribeRequest(), timeout=60)
            rows = []
            for num_tokens in lengths:
                rid = f"bench-{num_tokens}"
                _prefill(stub, rid, num_tokens, info.block_size, info.vocab_size)
                n = -(-num_tokens // info.block_size)
                samples = asyncio.run(_imports(target, source, rid, n, num_tokens, auth,
                                               repeats))
                stub.Release(pb.ReleaseRequest(request_ids=[rid]), timeout=60)
                elapsed = median([s[0] for s in samples])
                rows.append({
                    "num_tokens": num_tokens, "num_blocks": n, "num_bytes": samples[0][2],
                    "import_ms": round(elapsed, 3),
                    "round_trip_ms": round(median([s[1] for s in samples]), 3),
                    "ms_per_block": round(elapsed / n, 4),
                    "mb_per_s": round(samples[0][2] / 1e6 / (elapsed / 1e3), 1),
                    "samples_import_ms": [round(s[0], 3) for s in samples],
                })
            channel.close()
        finally:
            for process, _ in started:
                process.terminate()
                process.wait(timeout=60)
    layout = info.kv_layout
    return {"model": info.model_name, "dtype": layout.dtype, "block_size": layout.block_size,
            "bytes_per_block": layout.bytes_per_block, "format": layout.format,
            "repeats": repeats, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.kv_handoff", description=__doc__)
    parser.add_argument("--model", default="smollm2",
                        help="smollm2 (the embedded real model), tiny (tiny-llama, dummy "
                        "weights) or a model directory")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)),
                        help="request lengths in tokens, comma-separated")
    parser.add_argument("--repeats", type=int, default=5, help="imports per length (median)")
    parser.add_argument("--note", default="", help="saved with the results (e.g. the load)")
    args = parser.parse_args()
    result = run(_model_dir(args.model), [int(n) for n in args.lengths.split(",")],
                 args.repeats)
    result["note"] = args.note
    path = write_results("kv_handoff", result)
    headers = ["tokens", "blocks", "MB", "import ms", "round trip ms", "ms/block", "MB/s"]
    print(f"{result['model']} {result['dtype']}, block {result['block_size']}, "
          f"{result['bytes_per_block']:,} bytes a block; medians of {args.repeats}")
    print(markdown_table(headers, [
        [r["num_tokens"], r["num_blocks"], round(r["num_bytes"] / 1e6, 2), r["import_ms"],
         r["round_trip_ms"], r["ms_per_block"], r["mb_per_s"]] for r in result["rows"]]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
