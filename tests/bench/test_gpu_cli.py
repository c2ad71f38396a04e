"""bench.gpu's command line: a wrong stage is refused before anything needs CUDA."""

from __future__ import annotations

import pytest

from bench import gpu


def test_an_unknown_stage_is_a_usage_error_naming_it_and_the_stages(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        gpu.main(["--stage", "kernel,warp"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown stage(s) warp" in err and "kernel, e2e, parity, memory" in err

