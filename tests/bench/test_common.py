"""Every benchmark results file says which machine its figures came from."""

from __future__ import annotations

import json

import torch

from bench import common
from common.cpu_info import cpu_vendor
from executor_svc.cpu_kernels import MARCH


def test_a_results_file_records_its_cpu_threads_and_kernel_targets(  # type: ignore[no-untyped-def]
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    path = common.write_results("probe", {"figure": 1})
    assert path == tmp_path / "probe.json"  # never into the repository's bench/results
    assert common.write_results("other", {}, tmp_path / "out") == tmp_path / "out" / "other.json"
    written = json.loads(path.read_text())
    assert written["figure"] == 1
    recorded = written["machine"]
    assert recorded["cpu"] == common.cpu() and recorded["cpu"]["model"]
    assert recorded["cpu"]["vendor"] == cpu_vendor()  # what picks the matmul library
    assert recorded["torch_threads"] == torch.get_num_threads()
    assert recorded["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert recorded["kernel_march"] == MARCH
