"""Executor conformance: the contract of pagedkv.executor.v1, checked over gRPC only.

    make conformance EXECUTOR_ADDR=host:port      # an executor you run (yours or ours)
    pytest -q tests/conformance                   # no address: starts ours as subprocesses

LoRA (LoadLoraAdapter, SequenceWork.lora_adapter) writes PEFT adapters of seeded random
weights where the executor reads them (`--lora-dir`, default a temporary directory: an
executor on this machine) and compares with PEFT's model of each.

KV hand-off (ImportKV from one executor to another, test_executor_handoff.py) needs a second
executor of the same model, block size and layout: `--executor-addr-2 host:port` (or
EXECUTOR_ADDR_2); with one address only, the cases that move a request between two
executors skip, saying so. Without any address the suite runs twice, each time against two
executors of ours it starts: the real one (`[real]`), then the simulated one (`[simulated]`).

The suite plays the gateway: its calls carry `authorization: Bearer $PAGEDKV_ROLE_TOKEN` (the
gateway's role token) when that variable is set, and ExportKV, another executor's call, carries
$PAGEDKV_EXECUTOR_TOKEN (unset: the same token). An executor must refuse callers without a
credential, and one that tells roles apart refuses an executor's token for Execute
(test_executor_auth.py). The local executors get a generated set of role tokens.

Parity needs a local reference with the executor's weights: `--reference-model DIR` (default:
models/<model_name from Describe>) loaded from safetensors, or with `--reference-seed N` the
seeded dummy weights that `--load-format dummy --seed N` gives (the default seed is 0; drawn on
the CPU whatever the device, so a CUDA executor's are the same). The reference runs in float32
on the device Describe names when this machine has it (seeded draws then come from that
device's generator, as the executor's do), else on the CPU.

`--executor-device cuda` starts the suite's own executor on CUDA (the real one only: the
simulated executor has no device), e.g. on a lent GPU machine:
`python -m pytest -q tests/conformance --executor-device cuda`.

A simulated executor (`python -m executor_svc.simulated`) says so in Describe (backend
"simulated"): its reference is then its token model (executor_svc/simulated/token_model.py),
built from Describe's vocabulary and EOS ids, and every parity case checks the contract
(positions, tables, chunks, forks, swaps, sampled tokens used ahead) against it. It applies
no logits processors: the cases about their numerics call `require_model_logits`, which
skips them for it with a message saying why.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import torch
from transformers import PreTrainedModel

from common.credentials import ROLE_TOKEN_ENV, InternalAuth, RoleTokens
from executor_svc.model_loader import load_model
from executor_svc.simulated.runner import SIMULATED_BACKEND
from executor_svc.simulated.token_model import TokenModel, digest_of
from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.executor.v1 import executor_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 120.0
EXECUTOR_TOKEN_ENV = "PAGEDKV_EXECUTOR_TOKEN"  # what ExportKV carries (unset: the gateway's)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("conformance", "executor conformance suite")
    group.addoption("--executor-addr", default="", help="host:port of the executor under test")
    group.addoption("--executor-addr-2", default="",
                    help="host:port of a second executor like it (KV hand-off cases)")
    group.addoption("--reference-model", default="", help="model directory for the reference")
    group.addoption("--reference-seed", type=int, default=0, help="seed of dummy weights")
    group.addoption("--lora-dir", default="",
                    help="a directory the executor under test reads at the same path, where the "
                    "LoRA cases write their adapters (default: a temporary one, which only "
                    "executors on this machine can read)")
    group.addoption("--executor-device", default="cpu",
                    help="device of the executor the suite starts itself (cpu or cuda)")


@dataclass(slots=True)
class Blocks:
    """Hands out the executor's block ids in a scattered order; tests give them back."""

    free: list[int]
    free_cpu: list[int]

    def take(self, n: int) -> list[int]:
        assert len(self.free) >= n, "the executor has too few blocks for the conformance suite"
        return [self.free.pop() for _ in range(n)]

    def take_cpu(self, n: int) -> list[int]:
        return [self.free_cpu.pop() for _ in range(n)]


@dataclass(slots=True)
class Executor:
    """A client for the executor under test plus what Describe said about it."""

    stub: pb_grpc.ExecutorServiceStub
    channel: grpc.Channel
    info: pb.DescribeResponse
    blocks: Blocks
    export_stub: pb_grpc.ExecutorServiceStub  # with another executor's credential (ExportKV)
    export_channel: grpc.Channel
    address: str = ""  # host:port, as the suite (and another executor) reaches it
    tables: dict[str, list[int]] = field(default_factory=dict)
    held: dict[str, int] = field(default_factory=dict)

    def work(
        self, rid: str, tokens: list[int], sample: bool = True, **sampling: float
    ) -> pb.SequenceWork:
        """The next SequenceWork for `rid`, with blocks for its new tokens."""
        start = self.held.get(rid, 0)
        table = self.tables.setdefault(rid, [])
        needed = -(-(start + len(tokens)) // self.info.block_size) - len(table)
        new = self.blocks.take(max(needed, 0))
        work = pb.SequenceWork(
            request_id=rid,
            token_ids=tokens,
            start_position=start,
            delta=pb.BlockTableDelta(start_index=len(table), block_ids=new),
            sample=sample,
        )
        if rid not in self.held:
            work.sampling.CopyFrom(pb.SamplingParams(**sampling))
        table.extend(new)
        self.held[rid] = start + len(tokens)
        return work

    def execute(self, *seqs: pb.SequenceWork, **ops: object) -> pb.ExecuteResponse:
        return self.stub.Execute(pb.ExecuteRequest(seqs=list(seqs), **ops))  # type: ignore[arg-type]

    def forget(self, *rids: str) -> None:
        """Release on the executor and give the blocks back."""
        self.stub.Release(pb.ReleaseRequest(request_ids=list(rids)))
        for rid in rids:
            self.blocks.free.extend(self.tables.pop(rid, []))
            self.held.pop(rid, None)


# The executors the suite starts when given no address: this project's, and its simulated one
# (which passes all but the two cases about logits processors' numerics, skipped saying why).
LOCAL_KINDS = {
    "real": [sys.executable, "-m", "executor_svc", "--model", str(ROOT / "models" / "tiny-llama"),
             "--load-format", "dummy", "--seed", "0", "--kv-cache-memory", "8MiB",
             "--swap-space", "0.002", "--enable-lora", "--max-loras", "2",
             "--max-lora-rank", "16"],
    "simulated": [sys.executable, "-m", "executor_svc.simulated",
                  "--model", str(ROOT / "models" / "tiny-llama"), "--time-scale", "0",
                  "--num-blocks", "512", "--num-cpu-blocks", "64", "--metrics-port", "-1"],
}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Against the executors the suite starts itself no case may skip, but the simulated
    one's logits-processor cases (`require_model_logits`): a skip there would hide a gap."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    callspec = getattr(item, "callspec", None)
    kind = callspec.params.get("executor_kind") if callspec is not None else None
    if not report.skipped or kind not in LOCAL_KINDS:
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if kind == "simulated" and SIMULATED_SKIP in reason:
        return
    report.outcome = "failed"
    report.longrepr = f"this project's {kind} executor must run every case; it skipped: {reason}"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every case that reaches an executor runs against each kind the suite starts itself, or
    once against the address given."""
    if "executor_kind" in metafunc.fixturenames:
        kinds = ["given"] if _remote(metafunc.config) else list(LOCAL_KINDS)
        if _local_device(metafunc.config) != "cpu":
            kinds = [k for k in kinds if k != "simulated"]
        metafunc.parametrize("executor_kind", kinds, scope="session")


def _local_device(config: pytest.Config) -> str:
    return str(config.getoption("executor_device"))


def _start_local_executor(
    kind: str, log_path: Path, port_file: Path, env: dict[str, str], device: str = "cpu"
) -> subprocess.Popen[bytes]:
    command = [*LOCAL_KINDS[kind], "--max-num-seqs", "16", "--max-num-batched-tokens", "512",
               "--log-json", "--port", "0", "--port-file", str(port_file)]
    if device != "cpu":  # the real executor only (pytest_generate_tests)
        command += ["--device", device, "--dtype", "float32",
                    "--gpu-memory-utilization", "0.3"]
    env = {**os.environ, **env}
    with log_path.open("wb") as log:
        return subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env=env)


def _wait_for_port(process: subprocess.Popen[bytes], port_file: Path, log_path: Path) -> int:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if port_file.exists():
            return int(port_file.read_text())
        if process.poll() is not None:
            break
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"executor did not start; its log:\n{log_path.read_text()[-3000:]}")


@pytest.fixture(scope="session")
def role_tokens() -> RoleTokens:
    """The local executors' credentials (a remote one's come from the environment)."""
    return RoleTokens.new()


def _remote(pytestconfig: pytest.Config) -> bool:
    return bool(pytestconfig.getoption("executor_addr") or os.environ.get("EXECUTOR_ADDR"))


@pytest.fixture(scope="session")
def internal_auth(pytestconfig: pytest.Config, role_tokens: RoleTokens) -> InternalAuth:
    """The gateway's credential, which the executor under test requires (none: an executor
    run without)."""
    if _remote(pytestconfig):
        return InternalAuth(token=os.environ.get(ROLE_TOKEN_ENV, ""))
    return role_tokens.auth("gateway")


@pytest.fixture(scope="session")
def executor_auth(pytestconfig: pytest.Config, role_tokens: RoleTokens,
                  internal_auth: InternalAuth) -> InternalAuth:
    """Another executor's credential: what ExportKV's callers carry."""
    if _remote(pytestconfig):
        return InternalAuth(token=os.environ.get(EXECUTOR_TOKEN_ENV, "") or internal_auth.token)
    return role_tokens.auth("executor")


@pytest.fixture(scope="session")
def executor_addr(
    pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory,
    role_tokens: RoleTokens, executor_kind: str,
) -> Iterator[str]:
    addr = pytestconfig.getoption("executor_addr") or os.environ.get("EXECUTOR_ADDR", "")
    if addr:
        yield addr
        return
    workdir = tmp_path_factory.mktemp(f"executor-{executor_kind}")
    log_path, port_file = workdir / "executor.log", workdir / "port"
    process = _start_local_executor(executor_kind, log_path, port_file,
                                    role_tokens.env("executor"), _local_device(pytestconfig))
    port = _wait_for_port(process, port_file, log_path)
    yield f"127.0.0.1:{port}"
    process.terminate()
    assert process.wait(timeout=30) == 0, log_path.read_text()[-3000:]


@pytest.fixture(scope="session")
def second_executor_addr(
    pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory,
    role_tokens: RoleTokens, executor_kind: str,
) -> Iterator[str]:
    """A second executor of the same model and layout, for KV hand-off: given, or (when the
    suite started the first one) another of ours; with one address given, the cases skip."""
    addr = pytestconfig.getoption("executor_addr_2") or os.environ.get("EXECUTOR_ADDR_2", "")
    if addr:
        yield addr
        return
    if pytestconfig.getoption("executor_addr") or os.environ.get("EXECUTOR_ADDR", ""):
        pytest.skip(
            "KV hand-off between two executors needs a second one of the same model, block "
            "size and KV layout, and only one address was given: run `make conformance "
            "EXECUTOR_ADDR=host:port EXECUTOR_ADDR_2=host:port` (or pytest's "
            "--executor-addr-2)"
        )
    workdir = tmp_path_factory.mktemp(f"executor-2-{executor_kind}")
    log_path, port_file = workdir / "executor.log", workdir / "port"
    process = _start_local_executor(executor_kind, log_path, port_file,
                                    role_tokens.env("executor"), _local_device(pytestconfig))
    port = _wait_for_port(process, port_file, log_path)
    yield f"127.0.0.1:{port}"
    process.terminate()
    assert process.wait(timeout=30) == 0, log_path.read_text()[-3000:]


def _connect(addr: str, auth: InternalAuth, exporter: InternalAuth, seed: int = 0) -> Executor:
    """`seed`: the order blocks are handed out in (the second executor's differs, so that a
    block id never means the same block on both)."""
    channel = auth.channel(addr)
    grpc.channel_ready_future(channel).result(timeout=30)
    stub = pb_grpc.ExecutorServiceStub(channel)
    info = stub.Describe(pb.DescribeRequest(), timeout=30)
    free = list(range(info.num_blocks))
    random.Random(seed).shuffle(free)
    blocks = Blocks(free=free, free_cpu=list(range(info.num_cpu_blocks)))
    export_channel = exporter.channel(addr)
    return Executor(stub=stub, channel=channel, info=info, blocks=blocks,
                    export_stub=pb_grpc.ExecutorServiceStub(export_channel),
                    export_channel=export_channel, address=addr)


@pytest.fixture(scope="session")
def executor(executor_addr: str, internal_auth: InternalAuth,
             executor_auth: InternalAuth) -> Iterator[Executor]:
    connected = _connect(executor_addr, internal_auth, executor_auth)
    yield connected
    connected.channel.close()
    connected.export_channel.close()


@pytest.fixture(scope="session")
def second_executor(second_executor_addr: str, internal_auth: InternalAuth,
                    executor_auth: InternalAuth) -> Iterator[Executor]:
    connected = _connect(second_executor_addr, internal_auth, executor_auth, seed=1)
    yield connected
    connected.channel.close()
    connected.export_channel.close()


@dataclass(frozen=True, slots=True)
class SimulatedReference:
    """A simulated executor's model: its token model, and the limits Describe gave."""

    tokens: TokenModel
    config: SimpleNamespace  # vocab_size, max_position_embeddings (as a model config's)

    @classmethod
    def of(cls, info: pb.DescribeResponse) -> SimulatedReference:
        return cls(TokenModel(info.vocab_size, frozenset(info.eos_token_ids)),
                   SimpleNamespace(vocab_size=info.vocab_size,
                                   max_position_embeddings=info.max_model_len))


Reference = PreTrainedModel | SimulatedReference


def is_simulated(executor: Executor) -> bool:
    return executor.info.backend == SIMULATED_BACKEND


SIMULATED_SKIP = "the executor under test is simulated"


def require_model_logits(executor: Executor) -> None:
    """Cases that compare a model's processed logits (penalties, bias, min_tokens)."""
    if is_simulated(executor):
        pytest.skip(
            f"{SIMULATED_SKIP} (Describe: backend 'simulated'): it samples "
            "greedily from a hash of the context and applies no logits processors, so the "
            "numerics of penalties, logit_bias and min_tokens are not checked against it; "
            "they run against an executor with a model, e.g. this project's: "
            ".venv/bin/python -m pytest -q tests/conformance"
        )


@pytest.fixture(scope="session")
def reference(pytestconfig: pytest.Config, executor: Executor) -> Reference:
    """transformers' own model (sdpa attention) with the executor's weights, in float32 on
    the executor's device when this machine has it, else on the CPU; for a simulated
    executor, its token model."""
    if is_simulated(executor):
        return SimulatedReference.of(executor.info)
    path = reference_dir(pytestconfig, executor)
    seed = pytestconfig.getoption("reference_seed")
    has_weights = any(Path(path).glob("*.safetensors"))
    device = _reference_device(executor.info.device)
    loaded = load_model(
        path, "auto" if has_weights else "dummy", "float32", device, seed, fused_layers=False
    )
    model = loaded.model
    model.set_attn_implementation("sdpa")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def reference_dir(pytestconfig: pytest.Config, executor: Executor) -> str:
    """The reference's model directory (--reference-model, else models/<Describe's name>)."""
    return str(pytestconfig.getoption("reference_model")
               or ROOT / "models" / executor.info.model_name)


def _reference_device(described: str) -> str:
    """The executor's device if this machine has one like it, else the CPU."""
    if described.startswith("cuda") and torch.cuda.is_available():
        return described
    return "cpu"


def reference_generate(model: Reference, prompt: list[int], num_new: int) -> list[int]:
    if isinstance(model, SimulatedReference):
        return model.tokens.generate(prompt, num_new)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt], device=model.device),
                             max_new_tokens=num_new, do_sample=False)
    return out[0, len(prompt) :].tolist()


def reference_logprobs(model: Reference, tokens: list[int]) -> torch.Tensor:
    """[T, V] on the CPU: row t after tokens[: t + 1]."""
    if isinstance(model, SimulatedReference):
        rows = [model.tokens.logits(digest_of(tokens[: t + 1])) for t in range(len(tokens))]
        return torch.log_softmax(torch.tensor(rows, dtype=torch.float64), dim=-1).float()
    with torch.inference_mode():
        logits = model(torch.tensor([tokens], device=model.device)).logits[0]
    return torch.log_softmax(logits.float(), dim=-1).cpu()


def require_optional(executor: Executor, described: str, sent: str) -> None:
    """An optional part of the contract: its cases run where Describe's `described` field
    says the executor implements it (a gateway sends the others none of `sent`)."""
    if not getattr(executor.info, described):
        pytest.skip(
            f"the executor under test reports {described} = {getattr(executor.info, described)} "
            f"(Describe), so the gateway never sends it {sent}; these cases run against an "
            "executor that implements them, e.g. this project's: "
            ".venv/bin/python -m pytest -q tests/conformance"
        )


def require_uses_sampled_tokens(executor: Executor) -> None:
    require_optional(executor, "uses_sampled_tokens", "use_sampled_token or step_id")
