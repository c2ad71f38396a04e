"""`make compose-e2e`: docker-compose.yml, run for real on a Docker engine.

    python -m tools.compose_e2e [--base-image IMAGE] [--torch-wheel WHEEL] [--compose CMD]

Builds the image with compose, checks it (every file readable by the user the services run
as; a CPU torch), starts the stack under its own project name on free loopback ports, waits
for every service's health check, asks the gateway over gRPC (pagedkv_client) and HTTP
(/v1/completions) for a real answer, checks that only the gateway's two ports are published
and only on 127.0.0.1, kills an executor's main process from the host (kill -9, so the
restart policy applies) and sees it come back healthy and serving; then `down -v`, always.
--torch-wheel installs torch from that wheel (copied into deploy/docker-wheels/ for the build)
where PyTorch's CPU wheel index is out of reach. Needs the docker CLI, an engine, and root
for the kill (the container's process belongs to uid 10001). Exit 0 only when all passed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from pagedkv_client import Client, PagedkvError

ROOT = Path(__file__).resolve().parent.parent
WHEELS_DIR = ROOT / "deploy" / "docker-wheels"
IMAGE = "pagedkv:latest"  # docker-compose.yml's
PROJECT = "pagedkv-e2e"
SERVICES = ("allocator", "executor", "gateway")
PROMPT, EXPECTED = "The capital of France is", "Paris"


class Failed(Exception):
    """A check of the stack that did not hold."""


def log(message: str) -> None:
    print(f"compose-e2e: {message}", flush=True)


def run(cmd: list[str], *, env: dict[str, str] | None = None, capture: bool = True,
        timeout: float = 120.0) -> str:
    done = subprocess.run(cmd, env=env, text=True, timeout=timeout, check=False,
                          stdout=subprocess.PIPE if capture else None,
                          stderr=subprocess.STDOUT if capture else None)
    if done.returncode != 0:
        raise Failed(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout or ''}")
    return done.stdout or ""


def compose_command(forced: str) -> list[str]:
    """`docker compose` (v2) where the plugin is there, else `docker-compose` (v1)."""
    if forced:
        return forced.split()
    if not shutil.which("docker"):
        raise Failed("no docker command: install Docker (an engine and its CLI)")
    v2 = subprocess.run(["docker", "compose", "version"], capture_output=True, check=False)
    if v2.returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise Failed("neither `docker compose` nor `docker-compose` is installed")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(what: str, check: Callable[[], bool], timeout_s: float) -> float:
    """Seconds until `check()` held; Failed past `timeout_s`."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout_s:
            raise Failed(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(1.0)
    return time.monotonic() - start


class Stack:
    """One compose project: its command line, environment and containers."""

    def __init__(self, compose: list[str], env: dict[str, str]) -> None:
        self.compose_cmd = [*compose, "-p", PROJECT, "-f", str(ROOT / "docker-compose.yml")]
        self.env = env

    def compose(self, *args: str, capture: bool = True, timeout: float = 300.0) -> str:
        return run([*self.compose_cmd, *args], env=self.env, capture=capture, timeout=timeout)

    def container(self, service: str) -> str:
        ids = self.compose("ps", "-q", service).split()
        if not ids:
            raise Failed(f"{service}: no container")
        return ids[0]

    def state(self, service: str) -> dict:
        return json.loads(run(["docker", "inspect", self.container(service)]))[0]

    def health(self, service: str) -> str:
        state = self.state(service)["State"]
        if not state["Running"] and not state["Restarting"]:
            raise Failed(f"{service}: exited with {state['ExitCode']}")
        return str(state.get("Health", {}).get("Status", "none"))

    def probe(self, service: str) -> bool:
        """The service's compose health check, run once now (docker exec): passes?"""
        test = self.state(service)["Config"]["Healthcheck"]["Test"]
        command = test[1:] if test[0] == "CMD" else ["sh", "-c", test[1]]
        done = subprocess.run(["docker", "exec", self.container(service), *command],
                              capture_output=True, timeout=30, check=False)
        return done.returncode == 0

    def all_healthy_first_time(self) -> bool:
        """Every service healthy; Failed as soon as one restarted (a crash loop at start)."""
        for service in SERVICES:
            if self.state(service)["RestartCount"]:
                raise Failed(f"{service} restarted while starting up (a crash loop?)")
        return all(self.health(service) == "healthy" for service in SERVICES)

    def all_containers(self) -> list[dict]:
        ids = self.compose("ps", "-q").split()
        return json.loads(run(["docker", "inspect", *ids])) if ids else []


def check_image() -> None:
    """The services' user reads every file; torch is the CPU build."""
    unreadable = run(["docker", "run", "--rm", "--user", "10001", "--entrypoint", "find", IMAGE,
                      "/app", "/opt/venv", "(", "!", "-readable", "-o", "-type", "d", "!",
                      "-executable", ")", "-print"])
    if unreadable.strip():
        raise Failed(f"not readable by uid 10001 in the image:\n{unreadable[:2000]}")
    torch = run(["docker", "run", "--rm", IMAGE, "python", "-c",
                 "import torch; print(torch.__version__, torch.version.cuda)"]).split()
    if torch[-1] != "None":
        raise Failed(f"the image's torch is a CUDA build: {' '.join(torch)}")
    size = int(run(["docker", "image", "inspect", "-f", "{{.Size}}", IMAGE]))
    log(f"image: every file readable by uid 10001; torch {torch[0]}; {size / 1e9:.2f} GB")


def port_problems(containers: list[dict], wanted: dict[str, str]) -> list[str]:
    """What `docker inspect` of the project's containers shows published beyond `wanted`
    (the gateway's container port -> host port, each on 127.0.0.1 alone)."""
    problems = []
    for info in containers:
        service = info["Config"]["Labels"].get("com.docker.compose.service", info["Name"])
        published = {port: bindings for port, bindings in info["NetworkSettings"]["Ports"].items()
                     if bindings}
        allowed = set(wanted) if service == "gateway" else set()
        problems += [f"{service} publishes {port}" for port in sorted(set(published) - allowed)]
        for port in sorted(set(published) & allowed):
            hosts = sorted({(b["HostIp"], b["HostPort"]) for b in published[port]})
            if hosts != [("127.0.0.1", wanted[port])]:
                problems.append(f"{service} {port} is published on {hosts}, "
                                f"not on 127.0.0.1:{wanted[port]} alone")
    return problems


def check_ports(stack: Stack, grpc_port: int, http_port: int) -> None:
    """Only the gateway's two ports are published, on 127.0.0.1 alone; not reachable from
    this machine's other address."""
    problems = port_problems(stack.all_containers(),
                             {"50051/tcp": str(grpc_port), "8000/tcp": str(http_port)})
    if problems:
        raise Failed("; ".join(problems))
    address = outside_address()
    if address is not None:
        with socket.socket() as sock:
            sock.settimeout(2.0)
            if sock.connect_ex((address, grpc_port)) == 0:
                raise Failed(f"the gateway answers on {address}:{grpc_port}, not only loopback")
    log(f"ports: only 50051 and 8000 published, on 127.0.0.1 alone "
        f"({address or 'no other address'} refused)")


def outside_address() -> str | None:
    """This machine's address on its default route (no packet is sent), if not loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("192.0.2.1", 9))  # TEST-NET-1: a route lookup only
        except OSError:
            return None
        address = str(sock.getsockname()[0])
    return None if address.startswith("127.") else address


def ask_grpc(grpc_port: int) -> str:
    with Client(f"127.0.0.1:{grpc_port}") as client:
        text = client.complete(PROMPT, max_tokens=8, temperature=0, timeout=60).text
    if EXPECTED not in text:
        raise Failed(f"gRPC: {PROMPT!r} -> {text!r}, no {EXPECTED!r}")
    return text


def ask_http(http_port: int) -> str:
    base = f"http://127.0.0.1:{http_port}"
    with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as response:
        model = json.load(response)["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    request = urllib.request.Request(f"{base}/v1/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        text = str(json.load(response)["choices"][0]["text"])
    if EXPECTED not in text:
        raise Failed(f"HTTP: {PROMPT!r} -> {text!r}, no {EXPECTED!r}")
    return text


def answers(grpc_port: int, http_port: int) -> bool:
    try:
        ask_grpc(grpc_port)
        ask_http(http_port)
    except (PagedkvError, OSError, Failed):
        return False
    return True


def kill_executor(stack: Stack, grpc_port: int, http_port: int, timeout_s: float) -> None:
    """kill -9 of the executor's main process from the host; the restart policy brings it
    back; meanwhile the gateway's health check fails; then it serves again."""
    before = stack.state("executor")
    pid, restarts = before["State"]["Pid"], before["RestartCount"]
    try:
        os.kill(pid, signal.SIGKILL)
    except PermissionError as exc:
        raise Failed(f"kill -9 {pid}: the executor runs as uid 10001; run as root") from exc
    start = time.monotonic()
    waits = [
        ("gateway's health check failing", lambda: not stack.probe("gateway")),
        ("executor restarted", lambda: stack.state("executor")["RestartCount"] > restarts),
        ("executor healthy", lambda: stack.health("executor") == "healthy"),
        ("gateway's health check passing", lambda: stack.probe("gateway")),
        ("gateway answering", lambda: answers(grpc_port, http_port)),
        ("gateway healthy", lambda: stack.health("gateway") == "healthy"),
    ]
    marks = []
    for what, check in waits:
        wait_for(what, check, timeout_s)
        marks.append(f"{what} {time.monotonic() - start:.1f} s")
    log(f"kill -9 of the executor (host pid {pid}), then: {', '.join(marks)}")


def check_stack(stack: Stack, grpc_port: int, http_port: int, timeout_s: float) -> None:
    start = time.monotonic()
    stack.compose("up", "-d", "--no-build", capture=False)
    wait_for("every service healthy", lambda: stack.all_healthy_first_time(), timeout_s)
    log(f"up: {', '.join(SERVICES)} healthy {time.monotonic() - start:.0f} s after `up`")
    log(f"gRPC: {PROMPT!r} -> {ask_grpc(grpc_port)!r}")
    log(f"HTTP /v1/completions: {PROMPT!r} -> {ask_http(http_port)!r}")
    check_ports(stack, grpc_port, http_port)
    kill_executor(stack, grpc_port, http_port, timeout_s)


def build_args(base_image: str, torch_wheel: Path | None) -> list[str]:
    args = ["--build-arg", f"BASE_IMAGE={base_image}"] if base_image else []
    if torch_wheel is not None:
        version = torch_wheel.name.split("-")[1]  # torch-2.13.0+cpu-cp311-...whl
        shutil.copy2(torch_wheel, WHEELS_DIR / torch_wheel.name)
        args += ["--build-arg", "TORCH_PIP_ARGS=", "--build-arg", f"TORCH_SPEC=torch=={version}"]
    return args


def _terminated(signum: int, frame: object) -> None:
    raise Failed("terminated (SIGTERM)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.compose_e2e")
    parser.add_argument("--base-image", default="", help="the Dockerfile's BASE_IMAGE")
    parser.add_argument("--torch-wheel", type=Path, help="a CPU torch wheel to install")
    parser.add_argument("--compose", default="", help="e.g. 'docker-compose' (default: found)")
    parser.add_argument("--timeout-s", type=float, default=600, help="per wait for health")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _terminated)  # still tear down
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDKV_")}
    grpc_port, http_port = free_port(), free_port()
    env |= {"PAGEDKV_GATEWAY_PORT": str(grpc_port), "PAGEDKV_HTTP_PORT": str(http_port)}
    try:
        stack = Stack(compose_command(args.compose), env)
    except Failed as exc:
        log(f"FAILED: {exc}")
        return 1
    copied = args.torch_wheel and WHEELS_DIR / args.torch_wheel.name
    failed = True
    try:
        start = time.monotonic()
        # Every service runs the one image pagedkv:latest: build it once, through the gateway.
        stack.compose("build", *build_args(args.base_image, args.torch_wheel), "gateway",
                      capture=False, timeout=3600)
        log(f"build: {time.monotonic() - start:.0f} s")
        check_image()
        check_stack(stack, grpc_port, http_port, args.timeout_s)
        failed = False
    except (Failed, PagedkvError, OSError, subprocess.TimeoutExpired) as exc:
        log(f"FAILED: {exc}")
    finally:
        if failed:
            subprocess.run([*stack.compose_cmd, "logs", "--tail=30"], env=env, check=False)
        subprocess.run([*stack.compose_cmd, "down", "-v", "--remove-orphans"], env=env,
                       check=False, timeout=300)
        if copied and copied.exists() and copied.resolve() != args.torch_wheel.resolve():
            copied.unlink()
    log("FAILED" if failed else "passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
