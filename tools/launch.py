"""`python -m tools.launch`: allocator, executor(s) and gateway as local subprocesses.

Starts them in dependency order, waits until each reports SERVING on the gRPC health
service, prints the gateway's gRPC and HTTP (OpenAI-compatible) addresses and the served
model's name, and stops everything on Ctrl-C / SIGTERM. A service that exits is restarted on
its ports (the others carry on: the gateway routes around a lost executor and waits out an
allocator outage); one that keeps failing (5 exits within a minute) stops the stack. The e2e
tests start their stacks with the same `Stack` (port 0).

Flags the launcher does not know itself go to the services that take them, read from each
service's own parser: `--block-size 32` reaches the executors, `--max-num-seqs 64` the gateway
and the executors, `--log-level debug` all three; a flag no service takes is a usage error.
The services run in the launcher's working directory (relative paths in flags mean what they
say there) with this checkout's packages first on their path, from wherever it is started.

The internal services are closed: the launcher generates one token per role (gateway,
allocator, executor; common.credentials), hands each child only its own role's token and the
digests of all three (PAGEDKV_ROLE_TOKEN, PAGEDKV_CALLER_DIGESTS), and writes them to its run
directory (mode 0600) for an operator's tools; with --tls-dir (the output of `make certs`)
they also speak mutual TLS, each with its own certificate.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from common.config import add_flag
from common.credentials import (
    CALLER_DIGESTS_ENV,
    LEGACY_TOKEN_ENV,
    ROLE_TOKEN_ENV,
    InternalAuth,
    RoleTokens,
    TlsFiles,
)
from common.model_dirs import DEFAULT_MODEL, PRESETS_DIR
from common.sharding import MAX_SHARDS
from executor_svc.host_memory import available_host_bytes
from executor_svc.settings import build_parser as executor_parser
from pagedkv_client import NO_RETRY, Client, PagedkvError
from tools.flag_routing import UsageError, route_flags, service_flags
from tools.health_probe import is_serving

HOST = "127.0.0.1"
RESTART_LIMIT = 5          # exits of one service within RESTART_WINDOW_S stop the stack
RESTART_WINDOW_S = 60.0
# How long each service gets after SIGTERM when the launcher stops: the gateway's drain
# (--shutdown-grace-s, 30 s by default) and its own shutdown, as compose's stop_grace_period.
STOP_GRACE_S = 40.0
REPO_ROOT = Path(__file__).resolve().parents[1]  # where `python -m <service>` imports from
class StackError(RuntimeError):
    """A service did not come up; the message names it and points at its log."""


@dataclass(frozen=True, slots=True)
class StackSpec:
    model: str = str(DEFAULT_MODEL)
    num_executors: int = 1
    # Disaggregated prefill and decode: the first this many executors get --role prefill,
    # the others --role decode (0: every executor --role both, or as executor_args say).
    num_prefill_executors: int = 0
    # Allocator processes the pools are split across (common/sharding.py: by pool id).
    allocator_shards: int = 1
    # The executors' module: the real one, or `executor_svc.simulated` (no model: a step
    # takes a cost model's time; for fleets on one machine).
    executor_module: str = "executor_svc"
    host: str = HOST             # every service binds it
    allocator_port: int = 50052  # the first shard's; the others follow (0: any free ports)
    executor_port: int = 50053   # the first; the others follow (0: any free ports)
    gateway_port: int = 50051
    # The HTTP API and the metrics ports: 0 (any free port) here, for tests and benchmarks;
    # the command line's defaults are 8000 and the services' own. -1: off.
    http_port: int = 0
    allocator_metrics_port: int | None = 0     # None: the allocator's default
    executor_metrics_port: int | None = 0      # the first; None: the executor's default
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
    tree: Path | None = None  # another checkout the module comes from (None: this one)
    role: str = "gateway"  # whose credentials it gets: gateway, allocator or executor
    address: str = ""  # host:port, once the port file says which
    exits: collections.deque[float] = field(default_factory=collections.deque)
    # Its HTTP endpoints (--http-port, --metrics-port): the files the launcher asked for the
    # bound ports in, and the ports once read.
    http_port_files: dict[str, Path] = field(default_factory=dict)
    http_ports: dict[str, int] = field(default_factory=dict)
    # The endpoints asked for "any free port" that no one needs to find again: a restart asks
    # for any free port again (the old one may be another process's by then).
    any_port_again: frozenset[str] = frozenset()


@dataclass(slots=True)
class Stack:
    spec: StackSpec
    services: list[Service] = field(default_factory=list)
    run_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="pagedkv-"))
    # One token per role (None: the children get none; a tree from before credentials).
    role_tokens: RoleTokens | None = field(default_factory=RoleTokens.new)
    workdir: str = field(default_factory=os.getcwd)  # the children's working directory

    @property
    def internal_auth(self) -> InternalAuth:
        """A gateway's credentials, which the stack's allocator answers (tests, tools); with
        TLS, the gateway's certificate is the client's."""
        return self.role_auth("gateway")

    def role_auth(self, role: str) -> InternalAuth:
        """`role`'s credentials (its token and, with TLS, its certificate)."""
        tls = self._tls_files(role)
        if self.role_tokens is None:
            return InternalAuth(tls=tls)
        return self.role_tokens.auth(role, tls)

    def write_credentials(self) -> Path | None:
        """Each role's token in the run directory (0600), for an operator's tools."""
        if self.role_tokens is None:
            return None
        folder = Path(self.run_dir) / "credentials"
        folder.mkdir(mode=0o700, exist_ok=True)
        for role, token in self.role_tokens.tokens:
            path = folder / f"{role}-token"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(token + "\n")
        (folder / "caller-digests").write_text(self.role_tokens.digests)
        return folder

    def _child_env(self, role: str, path: list[str]) -> dict[str, str]:
        """The launcher's environment, less any credential in it, plus `role`'s own."""
        dropped = (LEGACY_TOKEN_ENV, ROLE_TOKEN_ENV, CALLER_DIGESTS_ENV)
        env = {k: v for k, v in os.environ.items() if k not in dropped}
        if self.role_tokens is not None:
            env.update(self.role_tokens.env(role))
        return {**env, "PYTHONPATH": os.pathsep.join(path)}

    def _tls_files(self, role: str) -> TlsFiles | None:
        tls_dir = self.spec.tls_dir
        if not tls_dir:
            return None
        tls_dir = os.path.abspath(tls_dir)
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
    def connect_host(self) -> str:
        """Where the launcher reaches the services (loopback when they bind every interface)."""
        return HOST if self.spec.host in ("0.0.0.0", "::", "") else self.spec.host

    @property
    def gateway_addr(self) -> str:
        return self.by_name("gateway").address

    @property
    def allocator_addr(self) -> str:
        """The allocator of an unsharded stack."""
        return self.by_name("allocator").address

    def allocator_addrs(self) -> list[str]:
        """Every allocator shard's address, in shard order."""
        return [s.address for s in self.services
                if s.name == "allocator" or s.name.startswith("allocator-")]

    @staticmethod
    def allocator_name(shard: int, num_shards: int) -> str:
        return "allocator" if num_shards == 1 else f"allocator-{shard}"

    def executor_addrs(self) -> list[str]:
        return [s.address for s in self.services if s.name.startswith("executor")]

    def by_name(self, name: str) -> Service:
        return next(s for s in self.services if s.name == name)

    def start(self) -> Stack:
        """The allocator and executors, then a gateway over them."""
        self.start_backends()
        try:
            self.start_gateway("gateway", self.spec.gateway_port)
        except BaseException:
            self.stop()
            raise
        return self

    def start_backends(self) -> Stack:
        """The allocator and the executors, healthy (no gateway yet)."""
        spec = self.spec
        if spec.log_dir:
            os.makedirs(spec.log_dir, exist_ok=True)
        try:
            num_shards = spec.allocator_shards
            for shard in range(num_shards):
                sharding = ("--shard-index", str(shard), "--num-shards", str(num_shards))
                self._start(self.allocator_name(shard, num_shards), "allocator_svc",
                            spec.allocator_port + shard if spec.allocator_port else 0,
                            ("--host", spec.host, *self._tls_args("allocator"),
                             *(sharding if num_shards > 1 else ()), *spec.allocator_args),
                            ports=self._metrics_port("allocator", spec.allocator_metrics_port,
                                                     shard))
            for i in range(spec.num_executors):
                port = spec.executor_port + i if spec.executor_port else 0
                # Sharded, a pool's shard follows from its id: a name, not a port that
                # changes from run to run.
                pool_name = ("--pool-name", f"pool-{i}") if spec.allocator_shards > 1 else ()
                role: tuple[str, ...] = ()
                if spec.num_prefill_executors:
                    role = ("--role", "prefill" if i < spec.num_prefill_executors else "decode")
                self._start(f"executor-{i}", spec.executor_module, port,
                            ("--host", spec.host, "--model", spec.model, *pool_name, *role,
                             *self._tls_args("executor"), *spec.executor_args),
                            ports=self._metrics_port("executor", spec.executor_metrics_port, i))
            for service in self.services:
                self._wait_healthy(service)
        except BaseException:
            self.stop()
            raise
        return self

    def _metrics_port(self, role: str, port: int | None,
                      index: int = 0) -> dict[str, int | None]:
        """`--metrics-port` for one service, where it has the flag: `port` + index (0: any
        free port, -1: off). None: the service's default, which it gives up with a warning
        when taken; the second executor on gets the default + index, which it requires."""
        action = service_flags()[role].get("--metrics-port")
        if action is None:
            return {}
        if port is None:
            return {"--metrics-port": int(action.default) + index if index else None}
        return {"--metrics-port": port + index if port > 0 else port}

    def start_gateway(self, name: str, port: int = 0,
                      extra_args: tuple[str, ...] = ()) -> Service:
        """A gateway over the stack's allocator and executors (several may share them);
        `extra_args` after the stack's own gateway_args (the last of a flag wins)."""
        args = (
            "--host", self.spec.host, "--allocator-addr", ",".join(self.allocator_addrs()),
            "--executor-addrs", ",".join(self.executor_addrs()),
            "--model", self.spec.model, *self._tls_args("gateway"),
            *self._public_tls_args(), *self.spec.gateway_args, *extra_args,
        )
        has_http = "--http-port" in service_flags()["gateway"]
        service = self._start(name, "gateway", port, args,
                              ports={"--http-port": self.spec.http_port} if has_http else {})
        self._wait_healthy(service)
        return service

    def _start(self, name: str, module: str, port: int, args: tuple[str, ...],
               cwd: str | Path | None = None,
               ports: Mapping[str, int | None] | None = None) -> Service:
        """`cwd`: another checkout to run the module from (benchmarks compare commits).
        `ports`: HTTP endpoints by flag (--http-port, --metrics-port; None: the service's
        default port): the bound port of each is asked for in the flag's -file."""
        tree = Path(cwd) if cwd else None
        port_file = Path(self.run_dir) / f"{name}.port"
        http_port_files = {flag: Path(self.run_dir) / f"{name}{flag}" for flag in ports or {}}
        python = [sys.executable, "-m"] if tree else [sys.executable, "-P", "-m"]
        argv = [*python, module, "--port", str(port), "--port-file", str(port_file)]
        for flag, value in (ports or {}).items():
            argv += [*([flag, str(value)] if value is not None else []),
                     f"{flag}-file", str(http_port_files[flag])]
        argv += args
        log_path = os.path.join(self.spec.log_dir, f"{name}.log") if self.spec.log_dir else None
        run_in = tree or self.workdir
        role = {"allocator_svc": "allocator", "gateway": "gateway"}.get(module, "executor")
        # Metrics ports asked as 0: scrapers find them through the launcher's listing, never
        # configured in advance, so a restart need not win the old one back.
        any_port = frozenset(flag for flag, value in (ports or {}).items()
                             if flag == "--metrics-port" and value == 0)
        service = Service(name=name, process=self._spawn(argv, run_in, tree, log_path, role),
                          port_file=port_file, log_path=log_path, argv=argv, cwd=run_in,
                          tree=tree, role=role, http_port_files=http_port_files,
                          any_port_again=any_port)
        self.services.append(service)
        return service

    def _spawn(self, argv: list[str], cwd: str | Path, tree: Path | None,
               log_path: str | None, role: str) -> subprocess.Popen[bytes]:
        """Run `argv` in `cwd`, importing from `tree` (None: this checkout, first on the path
        and, with `python -P`, never shadowed by the working directory's own folders)."""
        out: IO[bytes] | None = None
        if log_path:
            out = open(log_path, "ab")  # noqa: SIM115 - the child holds its own copy
        path = [str(tree or REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = self._child_env(role, path)
        try:
            return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT if out else None,
                                    cwd=cwd, env=env, start_new_session=True)
        finally:
            if out is not None:
                out.close()

    def restart_exited(self) -> list[Service]:
        """Restart every service that has exited, on the ports it had (a metrics port asked as
        any free one: any free one again); returns them. Raises StackError when one has exited
        RESTART_LIMIT times within RESTART_WINDOW_S."""
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
            if service.address:  # the same ports: the others know them
                argv[argv.index("--port") + 1] = service.address.rsplit(":", 1)[1]
            for flag, port in service.http_ports.items():
                # (A flag not in argv: the default port, which the service takes again.)
                if flag in argv and flag not in service.any_port_again:
                    argv[argv.index(flag) + 1] = str(port)
            for path in (service.port_file, *service.http_port_files.values()):
                path.unlink(missing_ok=True)
            service.address = ""
            service.http_ports = {}
            service.argv = argv
            service.process = self._spawn(argv, service.cwd, service.tree, service.log_path,
                                          service.role)
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
                    service.address = f"{self.connect_host}:{int(text)}"
            # Every port speaks TLS with --tls-dir (the gateway's without client certificates,
            # which it accepts all the same), plaintext without.
            auth = self.internal_auth
            if service.address and is_serving(service.address, timeout_s=1.0, auth=auth):
                self._read_http_ports(service)
                return
            time.sleep(0.1)
        raise StackError(f"{service.name} not healthy after {self.spec.startup_timeout_s}s"
                         f"{_see(service)}")

    def _read_http_ports(self, service: Service) -> None:
        """The services write these before they serve gRPC; a file missing means that
        endpoint is off (or, for a default metrics port another process holds, given up)."""
        for flag, path in service.http_port_files.items():
            text = path.read_text().strip() if path.exists() else ""
            if text:
                service.http_ports[flag] = int(text)

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



def _model_dir(model: str) -> str:
    """A directory, or a preset's name under models/ (`--model tiny-llama`)."""
    if not Path(model).is_dir() and (PRESETS_DIR / model).is_dir():
        return str(PRESETS_DIR / model)
    return model



def gateway_model_name(stack: Stack) -> str | None:
    """The name the gateway serves the model under (None: it would not say, e.g. when every
    call needs an API key)."""
    tls = stack._tls_files("gateway")
    try:
        with Client(stack.gateway_addr, tls_ca=tls.ca if tls else None, retry=NO_RETRY,
                    timeout=5.0) as client:
            return client.model_info().model_name or None
    except PagedkvError:
        return None


def usage_text(stack: Stack, model_name: str | None = None) -> str:
    gateway = stack.by_name("gateway")
    addr = stack.gateway_addr.replace(HOST, "localhost")
    tls = stack._tls_files("gateway")
    client_tls = f" --tls-ca {tls.ca}" if tls else ""
    grpcurl_tls = f"-cacert {tls.ca}" if tls else "-plaintext"
    http_port = gateway.http_ports.get("--http-port")
    scheme = "https" if tls else "http"
    http = (f"HTTP {scheme}://{stack.connect_host}:{http_port}/v1 (OpenAI-compatible)"
            if http_port else "no HTTP API")
    model = f", model {model_name}" if model_name else ""
    metrics = [f"{s.name} {url}" for s in stack.services if (url := _metrics_url(stack, s))]
    client = f"{_python_here(stack.workdir)} -m tools.client --addr {addr}{client_tls}"
    lines = [
        "",
        f"gateway: gRPC {stack.gateway_addr}, {http}{model}",
        f"allocator {', '.join(stack.allocator_addrs())}, "
        f"executors {', '.join(stack.executor_addrs())}",
        *([f"metrics: {', '.join(metrics)}"] if metrics else []),
        "",
        f"  {client} --chat \"What is the capital of France?\" --temperature 0",
        f"  {client} \"The quick brown fox\" --max-tokens 32 --temperature 0",
    ]
    if http_port and model_name:
        curl_tls = f"--cacert {tls.ca} " if tls else ""
        lines.append(
            f"  curl {curl_tls}{scheme}://localhost:{http_port}/v1/chat/completions "
            "-H 'Content-Type: application/json' "
            f"-d '{{\"model\": \"{model_name}\", \"messages\": "
            "[{\"role\": \"user\", \"content\": \"Hi\"}]}'")
    lines += [
        f"  grpcurl {grpcurl_tls} "
        "-d '{\"text\": \"Hello\", \"sampling\": {\"max_tokens\": 16}}' "
        f"{addr} pagedkv.gateway.v1.GatewayService/Generate",
        "",
        "Ctrl-C stops everything.",
        "",
    ]
    return "\n".join(lines)


def _metrics_url(stack: Stack, service: Service) -> str | None:
    """Its /metrics: the executors' and the allocator's on a port of their own, the gateway's
    on its HTTP API's (TLS with --tls-dir)."""
    if port := service.http_ports.get("--metrics-port"):
        return f"http://{stack.connect_host}:{port}/metrics"
    if port := service.http_ports.get("--http-port"):
        scheme = "https" if stack.spec.tls_dir else "http"
        return f"{scheme}://{stack.connect_host}:{port}/metrics"
    return None


def _python_here(workdir: str) -> str:
    """This Python as the user types it in `workdir` (.venv/bin/python in the checkout; from
    elsewhere its full path, with the checkout on PYTHONPATH)."""
    if Path(workdir).resolve() == REPO_ROOT:
        return os.path.relpath(sys.executable, workdir)
    return f"PYTHONPATH={REPO_ROOT} {sys.executable}"


def build_parser() -> argparse.ArgumentParser:
    """The launcher's own flags (any other goes to the services, route_flags)."""
    p = argparse.ArgumentParser(
        prog="python -m tools.launch", description=__doc__, allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Any other flag goes to the services that take it (python -m gateway --help, "
               "python -m allocator_svc --help, python -m executor_svc --help).")
    add_flag(p, "--model", default=str(DEFAULT_MODEL),
             help="model directory (safetensors + tokenizer) or a preset under models/")
    add_flag(p, "--num-executors", type=int, default=1, help="executors (one KV pool each)")
    add_flag(p, "--prefill-executors", type=int, default=0,
             help="disaggregated prefill and decode: the first N executors compute prompts "
                  "(--role prefill) and hand each request, with its KV, to the others "
                  "(--role decode); 0: every executor does both")
    add_flag(p, "--host", default=HOST,
             help="interface every service binds (0.0.0.0: all of them)")
    add_flag(p, "--gateway-port", type=int, default=50051, help="gateway port (gRPC)")
    add_flag(p, "--http-port", type=int, default=8000,
             help="the gateway's HTTP API (OpenAI-compatible) and /metrics (0: any free port, "
                  "-1: off)")
    add_flag(p, "--allocator-shards", type=int, default=1,
             help="allocator processes the KV pools are split across (by pool id)")
    add_flag(p, "--allocator-port", type=int, default=50052,
             help="allocator port (sharded: the first shard's, the others follow)")
    add_flag(p, "--executor-port", type=int, default=50053, help="first executor port")
    add_flag(p, "--allocator-metrics-port", type=int, default=None,
             help="the allocator's /metrics (unset: its default; 0: any free port, -1: off)")
    add_flag(p, "--executor-metrics-port", type=int, default=None,
             help="the first executor's /metrics, the others' follow (unset: the executors' "
                  "default; 0: any free ports, -1: off)")
    add_flag(p, "--load-format", default="auto",
             help="executor weights: auto (the directory's; a config-only preset gets random "
                  "ones, with a warning) or dummy (random on purpose)")
    add_flag(p, "--log-dir", default=None, help="write each service's log here (created)")
    add_flag(p, "--tls-dir", default=None,
             help="mutual TLS between the services with the certificates in this directory "
                  "(make certs writes them to certs/)")
    return p


def parse_spec(argv: list[str] | None = None) -> StackSpec:
    p = build_parser()
    args, extra = p.parse_known_args(argv)
    if not 1 <= args.allocator_shards <= MAX_SHARDS:
        p.error(f"--allocator-shards must be in 1..{MAX_SHARDS}")
    if not 0 <= args.prefill_executors < max(args.num_executors, 1):
        p.error("--prefill-executors must be >= 0 and leave at least one decode executor: "
                f"got {args.prefill_executors} of --num-executors {args.num_executors}")
    try:
        routed = route_flags(extra, service_flags())
    except UsageError as exc:
        p.error(str(exc))
    problem = cpu_blocks_problem(routed["executor"], args.num_executors)
    if problem is not None:
        p.error(problem)
    return StackSpec(
        model=_model_dir(args.model), num_executors=args.num_executors,
        num_prefill_executors=args.prefill_executors,
        allocator_shards=args.allocator_shards, host=args.host,
        gateway_port=args.gateway_port, allocator_port=args.allocator_port,
        executor_port=args.executor_port, http_port=args.http_port,
        allocator_metrics_port=args.allocator_metrics_port,
        executor_metrics_port=args.executor_metrics_port,
        allocator_args=tuple(routed["allocator"]),
        executor_args=("--load-format", args.load_format, *routed["executor"]),
        gateway_args=tuple(routed["gateway"]), log_dir=args.log_dir, tls_dir=args.tls_dir,
    )


def cpu_blocks_problem(executor_args: Sequence[str], num_executors: int) -> str | None:
    """The executors started here keep their CPU blocks (swap space and the prefix cache's
    CPU tier) in this machine's memory: what they could not all get is refused before
    anything starts."""
    flags, _ = executor_parser().parse_known_args(list(executor_args))
    swap, tier = flags.swap_space, flags.cpu_cache_space  # (their signs: checked as routed)
    available = available_host_bytes()
    if tier <= 0 or swap < 0 or num_executors * (swap + tier) * 2**30 <= available:
        return None
    return (f"{num_executors} executor(s) x (--cpu-cache-space {tier:g} + --swap-space "
            f"{swap:g} GiB) is more than this machine's {available / 2**30:.1f} GiB of available "
            "memory; lower it (0: no CPU tier)")


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
    print(usage_text(stack, gateway_model_name(stack)), flush=True)
    credentials = stack.write_credentials()
    if credentials is not None:
        print(f"launch: role tokens in {credentials} (operator tools such as tools.pin take "
              f"the gateway's: {ROLE_TOKEN_ENV}=$(cat {credentials}/gateway-token))",
              file=sys.stderr, flush=True)
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
    stack.stop(timeout_s=STOP_GRACE_S)
    print("launch: stopped", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
