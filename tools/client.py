"""`python -m tools.client "prompt"`: stream a completion from the gateway to the terminal."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc

from common.config import add_flag
from common.credentials import AUTHORIZATION_KEY, BEARER, with_metadata
from pagedkv.gateway.v1 import gateway_pb2 as pb
from pagedkv.gateway.v1 import gateway_pb2_grpc as pb_grpc


def build_request(args: argparse.Namespace) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(
        max_tokens=args.max_tokens, top_k=args.top_k, stop=args.stop, n=args.n,
        ignore_eos=args.ignore_eos,
    )
    if args.temperature is not None:
        sampling.temperature = args.temperature
    if args.top_p is not None:
        sampling.top_p = args.top_p
    if args.seed is not None:
        sampling.seed = args.seed
    if args.chat:
        messages = [pb.ChatMessage(role="user", content=args.prompt)]
        if args.system:
            messages.insert(0, pb.ChatMessage(role="system", content=args.system))
        return pb.GenerateRequest(chat=pb.ChatMessages(messages=messages), sampling=sampling,
                                  cache_salt=args.cache_salt)
    return pb.GenerateRequest(text=args.prompt, sampling=sampling, cache_salt=args.cache_salt)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.client", description=__doc__)
    parser.add_argument("prompt")
    parser.add_argument("--chat", action="store_true",
                        help="send the prompt as a user message in the model's chat template")
    parser.add_argument("--system", default="", help="with --chat: a system message first")
    parser.add_argument("--addr", default="localhost:50051", help="gateway host:port")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=None, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("-n", type=int, default=1, help="completions")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--cache-salt", default="")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    add_flag(parser, "--api-key", default="",
             help="the gateway's API key (when it runs with --api-keys-file)")
    add_flag(parser, "--tls-ca", default="",
             help="the CA of the gateway's certificate (when it serves TLS)")
    args = parser.parse_args(argv)
    metadata = ((AUTHORIZATION_KEY, BEARER + args.api_key),) if args.api_key else ()
    if args.tls_ca:
        credentials = grpc.ssl_channel_credentials(Path(args.tls_ca).read_bytes())
        plain = grpc.secure_channel(args.addr, credentials)
    else:
        plain = grpc.insecure_channel(args.addr)
    with with_metadata(plain, metadata) as channel:
        stub = pb_grpc.GatewayServiceStub(channel)
        try:
            for response in stub.Generate(build_request(args), timeout=args.timeout_s):
                prefix = f"[{response.index}] " if args.n > 1 and response.text else ""
                sys.stdout.write(prefix + response.text)
                sys.stdout.flush()
                if response.finish_reason:
                    sys.stdout.write("\n")
                    u = response.usage
                    finish = pb.FinishReason.Name(response.finish_reason)
                    print(
                        f"\n-- [{response.index}] {finish}: prompt {u.prompt_tokens}, "
                        f"completion {u.completion_tokens}, cached {u.cached_prompt_tokens} "
                        f"tokens (request {response.request_id})",
                        file=sys.stderr,
                    )
        except grpc.RpcError as exc:
            print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
