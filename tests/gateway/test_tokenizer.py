"""The gateway's tokenizer: loading a model directory, and chat templates."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common.errors import InvalidArgument
from common.model_dirs import DEFAULT_MODEL, REPO_ROOT
from gateway.text.tokenizer import ChatTurn, Tokenizer, TokenizerLoadError

TINY = REPO_ROOT / "models" / "tiny-llama"


def test_tokenizer_chat_renders_the_models_template() -> None:
    # SmolLM2's template: its default system turn, the user turn, then the assistant header.
    tokenizer = Tokenizer.load(str(DEFAULT_MODEL))
    ids = tokenizer.render_chat([ChatTurn("user", "Hi")])
    text = tokenizer.hf.decode(ids)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_tokenizer_chat_without_a_template_is_invalid_argument() -> None:
    # A preset without a chat template: a precise error, not a made-up format.
    with pytest.raises(InvalidArgument, match="no chat template"):
        Tokenizer.load(str(TINY)).render_chat([ChatTurn("user", "Hi")])


def test_tokenizer_load_refuses_a_directory_without_one(tmp_path: Path) -> None:
    # config.json alone: the error names the files looked for and what to point --model at.
    shutil.copy(TINY / "config.json", tmp_path / "config.json")
    with pytest.raises(TokenizerLoadError, match="no tokenizer in .*tokenizer.json"):
        Tokenizer.load(str(tmp_path))


@pytest.mark.e2e  # (a Python subprocess)
def test_gateway_exits_with_one_line_when_the_tokenizer_is_missing(tmp_path: Path) -> None:
    # The gateway process: exit 2 and one error line, before it dials anything.
    shutil.copy(TINY / "config.json", tmp_path / "config.json")
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "--model", str(tmp_path), "--port", "0", "--insecure"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if "gateway_failed_to_start" in line]
    assert len(errors) == 1 and "no tokenizer in" in errors[0]
