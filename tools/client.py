"""`python -m tools.client "prompt"`: stream a completion from the gateway to the terminal.

Built on the client library (`pagedkv_client`): the text goes to stdout as it arrives, a
summary of each completion (finish reason, token counts, request id) to stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import Any

from common.config import add_flag
from pagedkv.gateway.v1 import gateway_pb2 as pb
from pagedkv_client import Client, Delta, PagedkvError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.client", description=__doc__)
    parser.add_argument("prompt")
    parser.add_argument("--chat", action="store_true",
                        help="send the prompt as a user message in the model's chat template")
    parser.add_argument("--system", default="", help="with --chat: a system message first")
    parser.add_argument("--addr", default="localhost:50051", help="gateway host:port")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=None, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("-n", type=int, default=1, help="completions")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--cache-salt", default="")
    parser.add_argument("--request-id", default="",
                        help="the request's id (unset: the gateway makes one)")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    add_flag(parser, "--api-key", default="",
             help="the gateway's API key (when it runs with --api-keys-file)")
    add_flag(parser, "--tls-ca", default="",
             help="the CA of the gateway's certificate (when it serves TLS)")
    return parser.parse_args(argv)


def _deltas(client: Client, args: argparse.Namespace) -> Iterator[Delta]:
    sampling: dict[str, Any] = dict(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, stop=args.stop, n=args.n,
        ignore_eos=args.ignore_eos or None)
    common: dict[str, Any] = dict(cache_salt=args.cache_salt, request_id=args.request_id,
                                  timeout=args.timeout_s)
    if not args.chat:
        return client.generate(args.prompt, **common, **sampling)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": args.prompt})
    return client.chat(messages, stream=True, **common, **sampling)


def _print(delta: Delta, n: int) -> None:
    prefix = f"[{delta.index}] " if n > 1 and delta.text else ""
    sys.stdout.write(prefix + delta.text)
    sys.stdout.flush()
    if delta.finish_reason is not None:
        sys.stdout.write("\n")
        u = delta.usage
        counts = (f"prompt {u.prompt_tokens}, completion {u.completion_tokens}, cached "
                  f"{u.cached_prompt_tokens} tokens" if u else "no usage")
        finish = pb.FinishReason.Name(delta.raw.finish_reason)
        print(f"\n-- [{delta.index}] {finish}: {counts} (request {delta.request_id})",
              file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        with Client(args.addr, api_key=args.api_key or None,
                    tls_ca=args.tls_ca or None) as client:
            for delta in _deltas(client, args):
                _print(delta, args.n)
    except PagedkvError as exc:
        print(f"\nerror: {exc.code.name}: {exc.details}", file=sys.stderr)
        return 1
    except OSError as exc:  # the CA file
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the stream is closed on the way out: the request cancelled
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
