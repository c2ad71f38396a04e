"""The client tests run against the shared tiny stack (tests/conftest.py `tiny_stack`)."""

from __future__ import annotations

import pytest

from tests.e2e.e2e_stack import Clients


@pytest.fixture(scope="module")
def clients(tiny_stack: Clients) -> Clients:
    return tiny_stack

