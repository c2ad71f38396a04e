"""bench.openmp_runtime's command line: a variant it does not know is a usage error that names
the ones it does, before any stack starts."""

from __future__ import annotations

import pytest

from bench import openmp_runtime


def test_an_unknown_variant_is_a_usage_error_naming_the_known_ones(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        openmp_runtime.main(["--variants", "default,spinning"])
    assert exit_.value.code == 2
    assert "unknown variant 'spinning'; choose from default, passive, bind, iomp" in (
        capsys.readouterr().err)
