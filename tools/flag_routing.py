"""The launcher's flags for the services: any flag the launcher does not take itself goes to
every service whose own parser takes it, checked as that service checks it."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Mapping, Sequence

from allocator_svc.settings import build_parser as allocator_parser
from common.config import flag_problem
from executor_svc.settings import build_parser as executor_parser
from gateway.settings import build_parser as gateway_parser

# Flags the launcher sets on the services itself; given to it, each is a usage error saying
# what to use instead.
_PORT_FILES = "the launcher keeps the port files in its run directory"
MANAGED_FLAGS = {
    "--port": "use --gateway-port, --allocator-port and --executor-port",
    "--port-file": _PORT_FILES,
    "--http-port-file": _PORT_FILES,
    "--metrics-port-file": _PORT_FILES,
    "--metrics-port": "use --allocator-metrics-port and --executor-metrics-port (each "
                      "executor gets the next port)",
    "--allocator-addr": "the gateway is connected to the launcher's own allocator",
    "--executor-addrs": "the gateway is connected to the launcher's own executors "
                        "(--num-executors)",
    "--pool-name": "two executors must never share a pool: the launcher names them itself "
                   "(pool-0, pool-1, ... with --allocator-shards)",
    "--role": "use --prefill-executors N: the first N executors prefill, the others decode",
    "--num-shards": "use --allocator-shards: each shard gets its own index",
    "--shard-index": "use --allocator-shards: each shard gets its own index",
    "--tls-cert": "use --tls-dir (make certs): each service gets a certificate of its own",
    "--tls-key": "use --tls-dir (make certs): each service gets a certificate of its own",
    "--tls-ca": "use --tls-dir (make certs): each service gets a certificate of its own",
}



class UsageError(ValueError):
    """A launcher flag that cannot work; the message names it."""


@functools.cache
def service_flags() -> dict[str, dict[str, argparse.Action]]:
    """Every option of each service's own parser, by role (allocator, executor, gateway)."""
    parsers = {
        "allocator": allocator_parser(),
        "executor": executor_parser(),
        "gateway": gateway_parser(),
    }
    return {role: dict(p._option_string_actions) for role, p in parsers.items()}


def route_flags(extra: Sequence[str],
                flags: Mapping[str, Mapping[str, argparse.Action]]) -> dict[str, list[str]]:
    """Each of `extra` (flags the launcher does not take, with their values) for every role
    whose parser takes it. Raises UsageError naming a flag no service takes, one the launcher
    sets itself, or a value that the service's parser refuses."""
    routed: dict[str, list[str]] = {role: [] for role in flags}
    i = 0
    while i < len(extra):
        token = extra[i]
        flag, has_value, _ = token.partition("=")
        owners = [role for role, actions in flags.items() if flag in actions]
        if not token.startswith("-") or not owners:
            what = "argument" if not token.startswith("-") else "flag"
            raise UsageError(f"unrecognized {what} {token!r}: neither the launcher nor any "
                             "service takes it (see --help here and of python -m gateway, "
                             "allocator_svc, executor_svc)")
        if flag in MANAGED_FLAGS:
            raise UsageError(f"{flag} is set by the launcher: {MANAGED_FLAGS[flag]}")
        action = flags[owners[0]][flag]
        taken = [token]
        if action.nargs != 0 and not has_value:
            if i + 1 >= len(extra):
                raise UsageError(f"{flag} expects a value")
            taken.append(extra[i + 1])
            i += 1
        for role in owners:
            _check_value(flags[role][flag], taken, role)
            routed[role] += taken
        i += 1
    return routed


def _check_value(action: argparse.Action, taken: list[str], role: str) -> None:
    """The value as the service would read it (its parser's type, then its declared check)."""
    parser = argparse.ArgumentParser(exit_on_error=False, add_help=False)
    parser._add_action(action)
    try:
        parsed = parser.parse_args(taken)
    except argparse.ArgumentError as exc:
        raise UsageError(f"{role}: {exc}") from exc
    problem = flag_problem(action, getattr(parsed, action.dest))
    if problem is not None:
        raise UsageError(f"{role}: {problem}")
