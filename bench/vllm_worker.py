"""vLLM's side of `bench.vs_vllm`, run by vLLM CPU's own interpreter (.venv-vllm), never ours.

    .venv-vllm/bin/python bench/vllm_worker.py offline --model DIR   # commands on stdin
    .venv-vllm/bin/python bench/vllm_worker.py client --url URL --requests F --concurrency C --out F

offline: builds one `LLM` (vLLM's offline engine) and serves commands, one JSON line each on
stdin: {"requests": [[prompt ids, output length], ...], "out": path}. Every request is greedy
with a fixed output length (ignore_eos). It writes {"wall_s", "outputs"} to `out`, then prints
DONE_MARKER on stdout (vLLM's own logs go elsewhere or are skipped by the reader).

client: streams the same kind of requests to vLLM's OpenAI-compatible server with `c`
requests in flight (closed loop) and writes per-request token times.

Imports nothing from the project: this file runs beside vLLM's dependencies, not ours.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

DONE_MARKER = "PAGEDKV_VLLM_DONE"


def offline(args: argparse.Namespace) -> int:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, dtype=args.dtype, seed=0, max_model_len=args.max_model_len,
              kv_cache_memory_bytes=args.kv_cache_bytes)
    print(DONE_MARKER, flush=True)  # ready
    for line in sys.stdin:
        command = json.loads(line)
        prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in command["requests"]]
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                  for _, n in command["requests"]]
        start = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        outputs = [list(r.outputs[0].token_ids) for r in results]
        with open(command["out"], "w") as handle:
            json.dump({"wall_s": wall, "outputs": outputs}, handle)
        print(DONE_MARKER, flush=True)
    return 0


async def _client(args: argparse.Namespace) -> int:
    from openai import AsyncOpenAI

    with open(args.requests) as handle:
        requests = json.load(handle)
    client = AsyncOpenAI(base_url=args.url, api_key="unused", timeout=900)
    model = (await client.models.list()).data[0].id
    records: list[dict[str, object]] = [{} for _ in requests]
    origin = time.perf_counter()
    order = iter(range(len(requests)))

    async def one(i: int) -> None:
        prompt, length = requests[i]
        sent = time.perf_counter() - origin
        times: list[float] = []
        tokens: list[str] = []
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=length, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                times.append(time.perf_counter() - origin)
                tokens.append(chunk.choices[0].text)
        records[i] = {"sent_s": sent, "times": times, "num_chunks": len(tokens)}

    async def worker() -> None:
        for i in order:
            await one(i)

    await asyncio.gather(*(worker() for _ in range(min(args.concurrency, len(requests)))))
    with open(args.out, "w") as handle:
        json.dump({"wall_s": time.perf_counter() - origin, "records": records}, handle)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    off = sub.add_parser("offline")
    off.add_argument("--model", required=True)
    off.add_argument("--dtype", default="float32")
    off.add_argument("--max-model-len", type=int, default=2048)
    off.add_argument("--kv-cache-bytes", type=int, default=2 << 30)
    cli = sub.add_parser("client")
    cli.add_argument("--url", required=True)
    cli.add_argument("--requests", required=True)
    cli.add_argument("--concurrency", type=int, required=True)
    cli.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.mode == "offline":
        return offline(args)
    return asyncio.run(_client(args))


if __name__ == "__main__":  # LLM(...) spawns its engine process: only under __main__
    raise SystemExit(main())
