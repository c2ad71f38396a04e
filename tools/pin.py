"""`python -m tools.pin`: pin a prefix (a system prompt) in an allocator's pool, list the pins,
or unpin one. The pinned blocks are never evicted, within the pool's pin budget (the
allocator's --max-pinned-fraction).

    python -m tools.pin --allocator-addr HOST:PORT --pool POOL --token-ids 1,2,3,... [--name N]
    python -m tools.pin ... --pool POOL --text "You are ..." --model DIR
    python -m tools.pin ... --pool POOL --system "You are ..." --model DIR
    python -m tools.pin ... [--pool POOL] --list       (without --pool: every pool's)
    python -m tools.pin ... --pool POOL --unpin PIN_ID

The prefix is tokenized as the gateway tokenizes a prompt: `--text` as a text prompt (with the
tokenizer's BOS), `--system` as a chat's system turn in the model's chat template (a chat
request with that system message starts with exactly these tokens). Only full blocks are
pinned, so the tail where the next message's tokens may merge is left out.

Tenants do not share blocks: a prompt is pinned for one cache salt. `--cache-salt` is the salt
the allocator sees (a single-tenant gateway passes the caller's salt unchanged; usually empty).
Behind a gateway with API keys, `--tenant NAME` derives that tenant's salt as the gateway
does, from `--salt-secret-file` (or, as the gateway, from the gateway's role token when it
has no such file), joined with `--cache-salt`.

The allocator answers gateways alone: an operator's tool presents the gateway's credentials,
PAGEDKV_ROLE_TOKEN (or --role-token-file) holding the gateway's role token and/or, under
mutual TLS, a certificate the allocator takes as a gateway's (--tls-gateway-names there).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import grpc

from common.config import add_flag
from common.credentials import (
    CredentialsError,
    InternalAuth,
    add_internal_auth_flags,
    internal_auth_from_args,
)
from pagedkv.allocator.v1 import allocator_pb2 as pb
from pagedkv.allocator.v1 import allocator_pb2_grpc


class UsageError(ValueError):
    """Flags that cannot work together; the message says which."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.pin", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flag(parser, "--allocator-addr", default="localhost:50052", help="allocator host:port")
    parser.add_argument("--pool", default="", help="the pool's id (--list without it lists "
                        "every pool's pins)")
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--token-ids", help="the prefix as comma-separated token ids")
    action.add_argument("--text", help="the prefix as text, tokenized as a text prompt")
    action.add_argument("--system", help="the prefix as a chat's system message")
    action.add_argument("--list", action="store_true",
                        help="list the pool's pins (without --pool: every pool's)")
    action.add_argument("--unpin", metavar="PIN_ID", help="unpin this pin")
    parser.add_argument("--model", default="", help="with --text/--system: the model directory "
                        "whose tokenizer the gateway uses")
    parser.add_argument("--name", default="", help="a label for the pin")
    parser.add_argument("--cache-salt", default="", help="the salt the prefix is cached under")
    parser.add_argument("--tenant", default="", help="derive the salt of this tenant, as a "
                        "gateway with API keys does")
    add_flag(parser, "--salt-secret-file", default="",
             help="with --tenant: the gateways' --salt-secret-file")
    parser.add_argument("--timeout-s", type=float, default=10.0)
    add_internal_auth_flags(parser)
    return parser.parse_args(argv)


def token_ids(args: argparse.Namespace) -> list[int]:
    if args.token_ids is not None:
        try:
            return [int(t) for t in args.token_ids.split(",") if t.strip()]
        except ValueError as exc:
            raise UsageError(f"--token-ids: comma-separated integers expected ({exc})") from exc
    if not args.model:
        raise UsageError("--text and --system need --model: the directory of the tokenizer the "
                         "gateway uses")
    from gateway.text.tokenizer import Tokenizer, TokenizerLoadError

    try:
        tokenizer = Tokenizer.load(args.model)
    except TokenizerLoadError as exc:
        raise UsageError(str(exc)) from exc
    if args.text is not None:
        return tokenizer.encode(args.text)
    hf = tokenizer.hf
    if not getattr(hf, "chat_template", None):
        raise UsageError(f"--system: the model in {args.model} has no chat template; use --text")
    rendered = hf.apply_chat_template([{"role": "system", "content": args.system}],
                                      add_generation_prompt=False, tokenize=False)
    # NOTE: as the gateway encodes a rendered chat: the template writes the special tokens.
    return [int(t) for t in hf.encode(rendered, add_special_tokens=False)]


def cache_salt(args: argparse.Namespace, auth: InternalAuth) -> str:
    if not args.tenant:
        return str(args.cache_salt)
    from gateway.api.tenants import load_tenancy

    if not args.salt_secret_file and not auth.token:
        raise UsageError("--tenant needs the gateways' salt secret: --salt-secret-file, or the "
                         "gateway's role token they derive it from when they have none")
    tenancy = load_tenancy("", args.salt_secret_file, auth.token)
    # The derivation applies to a gateway with keys; which key maps to the tenant is moot here.
    keyed = dataclasses.replace(tenancy, tenants_by_key={"": args.tenant})
    return keyed.cache_salt(args.tenant, args.cache_salt)


def describe(pin: pb.PinInfo) -> str:
    return (f"{pin.pin_id}\tname={pin.name!r}\tblocks={pin.num_blocks}\ttokens={pin.num_tokens}"
            f"\tpinned={pin.num_pinned_blocks}\tpending={pin.num_pending_blocks}")


def run(args: argparse.Namespace, auth: InternalAuth) -> list[str]:
    """The lines to print."""
    with auth.channel(args.allocator_addr) as channel:
        stub = allocator_pb2_grpc.AllocatorServiceStub(channel)
        timeout = args.timeout_s
        if args.list:
            pool_ids = [args.pool] if args.pool else [
                p.pool_id for p in stub.GetStats(pb.GetStatsRequest(), timeout=timeout).pools]
            lines = []
            for pool_id in pool_ids:
                listed = stub.ListPins(pb.ListPinsRequest(pool_id=pool_id), timeout=timeout)
                lines.append(f"pool {pool_id}: {len(listed.pins)} pins name "
                             f"{listed.num_budget_blocks_used} of a budget of "
                             f"{listed.pin_budget_blocks} blocks")
                lines.extend(describe(p) for p in listed.pins)
            return lines
        if not args.pool:
            raise UsageError("--pool is required to pin or unpin (--list names the pools)")
        if args.unpin is not None:
            unpinned = stub.UnpinPrefix(pb.UnpinPrefixRequest(pool_id=args.pool,
                                                              pin_id=args.unpin),
                                        timeout=timeout)
            return [f"unpinned {describe(unpinned.pin)}\treleased="
                    f"{unpinned.num_released_blocks}"]
        request = pb.PinPrefixRequest(pool_id=args.pool, token_ids=token_ids(args),
                                      cache_salt=cache_salt(args, auth), name=args.name)
        pinned = stub.PinPrefix(request, timeout=timeout)
        return [f"{'pinned' if pinned.created else 'already pinned'} {describe(pinned.pin)}"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        auth = internal_auth_from_args(args, serves=False)
        lines = run(args, auth)
    except (UsageError, CredentialsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
