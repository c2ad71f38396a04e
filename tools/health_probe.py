"""`python -m tools.health_probe HOST:PORT [--any-of HOST:PORT,...]`: exit 0 when the gRPC
health service says SERVING (used by the launcher and by the compose health checks). Health
needs no credential, but a server with mutual TLS accepts only callers with a certificate:
pass the --tls-* flags (or their PAGEDKV_TLS_* variables) then.

--any-of: also at least one of these must say SERVING. The gateway's compose check names
its executors: an idle gateway learns that an executor is gone only from a failed step, and
would report SERVING meanwhile."""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.config import add_flag
from common.credentials import InternalAuth, TlsFiles


def is_serving(address: str, timeout_s: float = 2.0, service: str = "",
               auth: InternalAuth | None = None) -> bool:
    try:
        with (auth or InternalAuth()).channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            response = stub.Check(health_pb2.HealthCheckRequest(service=service),
                                  timeout=timeout_s)
    except grpc.RpcError:
        return False
    return bool(response.status == health_pb2.HealthCheckResponse.SERVING)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.health_probe")
    parser.add_argument("address", help="host:port of a gRPC server")
    parser.add_argument("--service", default="", help="service name ('' = the server)")
    parser.add_argument("--timeout-s", type=float, default=2.0)
    parser.add_argument("--any-of", default="",
                        help="comma-separated HOST:PORTs, one of which must serve too")
    add_flag(parser, "--tls-cert", default="", help="client certificate (mutual TLS)")
    add_flag(parser, "--tls-key", default="", help="its key")
    add_flag(parser, "--tls-ca", default="", help="the CA")
    args = parser.parse_args(argv)
    tls = (TlsFiles(args.tls_cert, args.tls_key, args.tls_ca)
           if args.tls_cert and args.tls_key and args.tls_ca else None)
    auth = InternalAuth(tls=tls)
    serving = is_serving(args.address, args.timeout_s, args.service, auth)
    others = [a for a in args.any_of.split(",") if a]
    if serving and others:
        serving = any(is_serving(a, args.timeout_s, "", auth) for a in others)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
