"""--cpu-cache-space: the CPU blocks of the prefix cache's CPU tier (beside the swap space),
its bad values at start, and the executor's checks of the CPU-block ids a step names."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

from common.errors import InvalidArgument
from executor_svc.runner import ModelRunner
from executor_svc.settings import SettingsError
from executor_svc.step import BlockCopy, StepRequest

from .oracle import MODELS, Driver, make_settings, random_prompts

ROOT = MODELS.parent
MIB = 1 / 1024  # GiB


def _main(*flags: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "executor_svc", "--model", str(MODELS / "tiny-llama"),
               "--port", "0", "--insecure", *flags]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("value", "message"), [
    ("-1", "python -m executor_svc: error: --cpu-cache-space must be >= 0 GiB (0: no CPU "
           "tier), not -1.0"),
    ("1000000", "python -m executor_svc: error: --cpu-cache-space 1e+06 GiB (with "
                "--swap-space 0.25 GiB) is more than this machine's"),
])
@pytest.mark.e2e  # (a Python subprocess)
def test_cpu_cache_space_bad_value_is_a_one_line_usage_error(value: str, message: str) -> None:
    result = _main("--cpu-cache-space", value)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(message), line


def test_cpu_cache_space_settings_refuse_without_loading_anything() -> None:
    with pytest.raises(SettingsError, match="available memory; lower it"):
        make_settings(cpu_cache_space=1e6)


def test_cpu_cache_space_adds_cpu_blocks_that_describe_reports(
    make_runner: Callable[..., ModelRunner],
) -> None:
    # tiny-llama at block size 16: 1 MiB of swap and 2 MiB of tier, in blocks of its size.
    runner = make_runner(cpu_cache_space=2 * MIB)
    per_block = runner.cache.spec.bytes_per_block
    swap, tier = 2**20 // per_block, 2 * 2**20 // per_block
    assert (runner.info.num_cpu_blocks, runner.info.num_cpu_cache_blocks) == (swap + tier, tier)
    assert runner.cache.num_cpu_blocks == swap + tier
    assert make_runner().info.num_cpu_cache_blocks == 0


def test_cpu_cache_space_tier_op_outside_the_cpu_blocks_changes_nothing(
    make_runner: Callable[..., ModelRunner],
) -> None:
    # A step that names a CPU block past the pool's in swap_out (or swap_in) is refused whole:
    # its releases, copies and sequences are not applied, the KV is untouched.
    runner = make_runner(cpu_cache_space=MIB)
    driver = Driver.scattered(runner)
    (prompt,) = random_prompts(runner.info.vocab_size, [20], seed=3)
    out = driver.generate({"r": prompt}, 2)["r"]
    num_cpu = runner.info.num_cpu_blocks
    kv, cpu_kv = runner.cache.kv.clone(), runner.cache.cpu_kv.clone()
    held = runner.requests["r"].num_tokens
    table = driver.tables["r"]
    for bad in (
        StepRequest(release_request_ids=("r",), swap_out=(BlockCopy(table[0], num_cpu),),
                    copies=((BlockCopy(table[0], table[1])),),
                    seqs=(driver.work("r", [out[-1]], sample=True),)),
        StepRequest(swap_in=(BlockCopy(num_cpu + 7, table[0]),),
                    seqs=(driver.work("r", [out[-1]], sample=True),)),
    ):
        kind = "destination" if bad.swap_out else "source"
        name = "swap_out" if bad.swap_out else "swap_in"
        block = num_cpu if bad.swap_out else num_cpu + 7
        with pytest.raises(InvalidArgument, match=(
                rf"^{name}: {kind} block {block} is outside \[0, {num_cpu}\) \(CPU blocks")):
            runner.execute(bad)
        assert "r" in runner.requests and runner.requests["r"].num_tokens == held
        assert torch.equal(runner.cache.kv, kv) and torch.equal(runner.cache.cpu_kv, cpu_kv)


def test_cpu_cache_space_two_copies_into_one_cpu_block_are_refused(
    make_runner: Callable[..., ModelRunner],
) -> None:
    runner = make_runner(cpu_cache_space=MIB)
    with pytest.raises(InvalidArgument, match="swap_out: destination block 3 is written twice"):
        runner.execute(StepRequest(swap_out=(BlockCopy(0, 3), BlockCopy(1, 3))))
