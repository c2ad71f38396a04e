"""A step's arrays: built on the host, sent in one copy, each one back as its own tensor."""

from __future__ import annotations

import pytest
import torch

from executor_svc.attention import StepArrays


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_step_arrays_come_back_in_their_own_dtype_and_order(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device here (torch.cuda.is_available() is False); on a CUDA "
                    "machine: python -m pytest -q -m gpu tests/executor/test_step_arrays.py")
    arrays = StepArrays(torch.device(device))
    tokens = arrays.add([5, 6, 7])
    table = arrays.add([9, 8], torch.int32)
    keep = arrays.add([2])
    empty = arrays.add([], torch.int32)
    with pytest.raises(AssertionError, match="send"):
        _ = tokens.tensor
    arrays.send()
    assert tokens.tensor.device.type == device
    assert tokens.tensor.tolist() == [5, 6, 7] and tokens.tensor.dtype == torch.long
    assert table.tensor.tolist() == [9, 8] and table.tensor.dtype == torch.int32
    assert keep.tensor.tolist() == [2] and empty.tensor.numel() == 0
    with pytest.raises(AssertionError, match="before it is sent"):
        arrays.add([1])
