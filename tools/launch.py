"""`python -m tools.launch`: allocator, executor(s) and gateway as local subprocesses.

Starts them in dependency order, waits until each reports SERVING on the gRPC health
service, prints how to call the gateway, and stops everything on Ctrl-C / SIGTERM. A service
that exits is restarted on its port (the others carry on: the gateway routes around a lost
executor and waits out an allocator outage); one that keeps failing (5 exits within a minute)
stops the stack. The e2e tests start their stacks with the same `Stack` (port 0).

The internal services are closed: the launcher generates an internal token (or takes
PAGEDKV_INTERNAL_TOKEN from its environment) and hands it to every child in that variable;
with --tls-dir (the output of `make certs`) they also speak mutual TLS, each with its own
certificate.
"""

from __future__ import annotations

import argparse
import collections
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from common.config import add_flag
from common.credentials import INTERNAL_TOKEN_ENV, InternalAuth, TlsFiles
from common.model_dirs import DEFAULT_MODEL
from tools.health_probe import is_serving

HOST = "127.0.0.1"
RESTART_LIMIT = 5          # exits of one service within RESTART_WINDOW_S stop the stack
RESTART_WINDOW_S = 60.0
REPO_ROOT = Path(__file__).resolve().parents[1]  # `python -m <service>` runs from here


class StackError(RuntimeError):
    """A service did not come up; the message names it and points at its log."""


@dataclass(frozen=True, slots=True)
class StackSpec:
    model: str = str(DEFAULT_MODEL)
    num_executors: int = 1
    allocator_port: int = 50052
    executor_port: int = 50053   # the first; the others follow (0: any free ports)
    gateway_port: int = 50051
    allocator_args: tuple[str, ...] = ()
    executor_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    log_dir: str | None = None   # None: children log to this terminal
    startup_timeout_s: float = 120.0
    tls_dir: str | None = None   # make certs' output: mutual TLS between the services


@dataclass(slots=True)
class Service:
    name: str
    process: subprocess.Popen[bytes]
    port_file: Path
    log_path: str | None
    argv: list[str]
    cwd: str | Path
    address: str = ""  # host:port, once the port file says which
    exits: collections.deque[float] = field(default_factory=collections.deque)


@dataclass(slots=True)
class Stack:
    spec: StackSpec
    services: list[Service] = field(default_factory=list)
    run_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="pagedkv-"))
    internal_token: str = field(
        default_factory=lambda: os.environ.get(INTERNAL_TOKEN_ENV) or secrets.token_urlsafe(32)
    )

    @property
    def internal_auth(self) -> InternalAuth:
        """The credential the stack's internal services require (tests, tools); with TLS,
        the gateway's certificate is the client's."""
        return InternalAuth(token=self.internal_token, tls=self._tls_files("gateway"))

    def _tls_files(self, role: str) -> TlsFiles | None:
        tls_dir = self.spec.tls_dir
        if not tls_dir:
            return None
        return TlsFiles(cert=os.path.join(tls_dir, f"{role}.pem"),
                        key=os.path.join(tls_dir, f"{role}-key.pem"),
                        ca=os.path.join(tls_dir, "ca.pem"))

    def _public_tls_args(self) -> tuple[str, ...]:
        """With --tls-dir the gateway's public port is TLS too (its own certificate)."""
        files = self._tls_files("gateway")
        if files is None:
            return ()
        return ("--public-tls-cert", files.cert, "--public-tls-key", files.key)

    def _tls_args(self, role: str) -> tuple[str, ...]:
        files = self._tls_files(role)
        if files is None:
            return ()
        return ("--tls-cert", files.cert, "--tls-key", files.key, "--tls-ca", files.ca)

    @property
    def gateway_addr(self) -> str:
        return self.by_name("gateway").address

    @property
    def allocator_addr(self) -> str:
        return self.by_name("allocator").address

    def executor_addrs(self) -> list[str]:
        return [s.address for s in self.services if s.name.startswith("executor")]

    def by_name(self, name: str) -> Service:
        return next(s for s in self.services if s.name == name)

    def start(self) -> Stack:
        spec = self.spec
        try:
            self._start("allocator", "allocator_svc", spec.allocator_port,
                        (*self._tls_args("allocator"), *spec.allocator_args))
            for i in range(spec.num_executors):
                port = spec.executor_port + i if spec.executor_port else 0
                self._start(f"executor-{i}", "executor_svc", port,
                            ("--model", spec.model, *self._tls_args("executor"),
                             *spec.executor_args))
            for service in self.services:
                self._wait_healthy(service)
            self.start_gateway("gateway", spec.gateway_port)
        except BaseException:
            self.stop()
            raise
        return self

    def start_gateway(self, name: str, port: int = 0) -> Service:
        """A gateway over the stack's allocator and executors (several may share them)."""
        args = (
            "--allocator-addr", self.allocator_addr,
            "--executor-addrs", ",".join(self.executor_addrs()),
            "--model", self.spec.model, *self._tls_args("gateway"),
            *self._public_tls_args(), *self.spec.gateway_args,
        )
        service = self._start(name, "gateway", port, args)
        self._wait_healthy(service)
        return service

    def _start(self, name: str, module: str, port: int, args: tuple[str, ...],
               cwd: str | Path | None = None) -> Service:
        """`cwd`: another checkout to run the module from (benchmarks compare commits)."""
        port_file = os.path.join(self.run_dir, f"{name}.port")
        argv = [sys.executable, "-m", module, "--port", str(port), "--port-file", port_file,
                *args]
        log_path = os.path.join(self.spec.log_dir, f"{name}.log") if self.spec.log_dir else None
        service = Service(name=name, process=self._spawn(argv, cwd or REPO_ROOT, log_path),
                          port_file=Path(port_file), log_path=log_path, argv=argv,
                          cwd=cwd or REPO_ROOT)
        self.services.append(service)
        return service

    def _spawn(self, argv: list[str], cwd: str | Path,
               log_path: str | None) -> subprocess.Popen[bytes]:
        out: IO[bytes] | None = None
        if log_path:
            out = open(log_path, "ab")  # noqa: SIM115 - the child holds its own copy
        env = {**os.environ, INTERNAL_TOKEN_ENV: self.internal_token}
        try:
            return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT if out else None,
                                    cwd=cwd, env=env, start_new_session=True)
        finally:
            if out is not None:
                out.close()

    def restart_exited(self) -> list[Service]:
        """Restart every service that has exited, on the port it had; returns them. Raises
        StackError when one has exited RESTART_LIMIT times within RESTART_WINDOW_S."""
        restarted = []
        for service in self.services:
            code = service.process.poll()
            if code is None:
                continue
            now = time.monotonic()
            service.exits.append(now)
            while service.exits and now - service.exits[0] > RESTART_WINDOW_S:
                service.exits.popleft()
            if len(service.exits) >= RESTART_LIMIT:
                raise StackError(f"{service.name} exited {len(service.exits)} times within "
                                 f"{RESTART_WINDOW_S:.0f}s (last: {code}){_see(service)}")
            argv = list(service.argv)
            if service.address:  # the same port: the others know it
                argv[argv.index("--port") + 1] = service.address.rsplit(":", 1)[1]
            service.port_file.unlink(missing_ok=True)
            service.address = ""
            service.argv = argv
            service.process = self._spawn(argv, service.cwd, service.log_path)
            restarted.append(service)
        for service in restarted:
            try:
                self._wait_healthy(service)
            except StackError:
                if service.process.poll() is None:
                    raise  # alive but never healthy: nothing a restart would change
                # It exited while starting: one more exit, restarted at the next call.
        return restarted

    def _wait_healthy(self, service: Service) -> None:
        deadline = time.monotonic() + self.spec.startup_timeout_s
        while time.monotonic() < deadline:
            if service.process.poll() is not None:
                raise StackError(f"{service.name} exited with {service.process.returncode}"
                                 f"{_see(service)}")
            if not service.address and service.port_file.exists():
                text = service.port_file.read_text().strip()
                if text:
                    service.address = f"{HOST}:{int(text)}"
            # Every port speaks TLS with --tls-dir (the gateway's without client certificates,
            # which it accepts all the same), plaintext without.
            auth = self.internal_auth
            if service.address and is_serving(service.address, timeout_s=1.0, auth=auth):
                return
            time.sleep(0.1)
        raise StackError(f"{service.name} not healthy after {self.spec.startup_timeout_s}s"
                         f"{_see(service)}")

    def kill(self, name: str) -> None:
        """Kill one service abruptly (tests: an executor that goes away)."""
        service = self.by_name(name)
        service.process.kill()
        service.process.wait(10)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM in reverse start order (gateway first), then SIGKILL what lingers; the run
        directory (port files) goes with them."""
        for service in reversed(self.services):
            if service.process.poll() is None:
                service.process.send_signal(signal.SIGTERM)
                try:
                    service.process.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    service.process.kill()
                    service.process.wait(5)
        shutil.rmtree(self.run_dir, ignore_errors=True)


def _see(service: Service) -> str:
    return f" (see {service.log_path})" if service.log_path else ""


def usage_text(stack: Stack) -> str:
    addr = stack.gateway_addr.replace(HOST, "localhost")
    tls = stack._tls_files("gateway")
    client_tls = f" --tls-ca {tls.ca}" if tls else ""
    grpcurl_tls = f"-cacert {tls.ca}" if tls else "-plaintext"
    return (
        f"\npagedkv is up: gateway {addr}, allocator {stack.allocator_addr}, "
        f"executors {', '.join(stack.executor_addrs())}\n\n"
        f"  .venv/bin/python -m tools.client --addr {addr}{client_tls} --chat "
        "\"What is the capital of France?\" --temperature 0\n"
        f"  .venv/bin/python -m tools.client --addr {addr}{client_tls} \"The quick brown fox\" "
        "--max-tokens 32 --temperature 0\n"
        f"  grpcurl {grpcurl_tls} "
        "-d '{\"text\": \"Hello\", \"sampling\": {\"max_tokens\": 16}}' "
        f"{addr} pagedkv.gateway.v1.GatewayService/Generate\n\n"
        "Ctrl-C stops everything.\n"
    )


def parse_spec(argv: list[str] | None = None) -> StackSpec:
    p = argparse.ArgumentParser(prog="python -m tools.launch", description=__doc__)
    add_flag(p, "--model", default=str(DEFAULT_MODEL),
             help="model directory (safetensors + tokenizer) or a preset under models/")
    add_flag(p, "--num-executors", type=int, default=1, help="executors (one KV pool each)")
    add_flag(p, "--gateway-port", type=int, default=50051, help="gateway port")
    add_flag(p, "--allocator-port", type=int, default=50052, help="allocator port")
    add_flag(p, "--executor-port", type=int, default=50053, help="first executor port")
    add_flag(p, "--load-format", default="auto",
             help="executor weights: auto (the directory's; a config-only preset gets random "
                  "ones, with a warning) or dummy (random on purpose)")
    add_flag(p, "--log-dir", default=None, help="write each service's log here")
    add_flag(p, "--tls-dir", default=None,
             help="mutual TLS between the services with the certificates in this directory "
                  "(make certs writes them to certs/)")
    args, extra = p.parse_known_args(argv)
    return StackSpec(
        model=args.model, num_executors=args.num_executors, gateway_port=args.gateway_port,
        allocator_port=args.allocator_port, executor_port=args.executor_port,
        executor_args=("--load-format", args.load_format), gateway_args=tuple(extra),
        log_dir=args.log_dir, tls_dir=args.tls_dir,
    )


def main(argv: list[str] | None = None) -> int:
    spec = parse_spec(argv)
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    stack = Stack(spec)
    try:
        stack.start()
    except StackError as exc:
        print(f"launch: {exc}", file=sys.stderr)
        return 1
    print(usage_text(stack), flush=True)
    failed = False
    while not stopping:
        time.sleep(0.2)
        try:
            for service in stack.restart_exited():
                print(f"launch: {service.name} exited; restarted on {service.address}",
                      file=sys.stderr, flush=True)
        except StackError as exc:
            print(f"launch: {exc}; stopping", file=sys.stderr)
            failed = True
            break
    stack.stop()
    print("launch: stopped", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
