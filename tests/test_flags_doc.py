"""FLAGS.md and the README's configuration table say what the parsers take."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tools.flags_doc import FLAGS_MD, SECTIONS, _parser, render

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
# The README's service column -> the parsers whose flags it names.
SERVICE_MODULES = {
    "launcher": "tools.launch",
    "gateway": "gateway.settings",
    "allocator": "allocator_svc.settings",
    "executor": "executor_svc.settings",
}


def test_flags_md_is_written_from_the_parsers():
    # Regenerate with `python -m tools.flags_doc` after changing a setting.
    assert FLAGS_MD.read_text() == render(), "FLAGS.md is out of date: python -m tools.flags_doc"


def test_flags_md_lists_every_flag_of_every_section():
    text = FLAGS_MD.read_text()
    for title, module, _ in SECTIONS:
        section = text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
        for action in _parser(module)._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help":
                    assert f"`{flag}`" in section or f"`{flag} " in section, (title, flag)


def test_the_readme_configuration_table_names_flags_its_services_take():
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:3] for line in table.splitlines() if line.startswith("| `--")]
    assert len(rows) >= 10
    for flags, services in rows:
        for service in (s.strip() for s in services.split(",")):
            taken = {f for a in _parser(SERVICE_MODULES[service])._actions
                     for f in a.option_strings}
            for flag in re.findall(r"--[a-z0-9-]+", flags):
                assert flag in taken, f"README: {service} does not take {flag}"
