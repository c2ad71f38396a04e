"""One real stack for the client tests (client_stack.py), shared by both modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from client_stack import start_client_stack

from tests.e2e.e2e_stack import Clients


@pytest.fixture(scope="session")
def clients(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Clients]:
    clients = start_client_stack(tmp_path_factory.mktemp("client-stack"))
    yield clients
    clients.close()
    clients.stack.stop()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "packaging: builds the project's wheel offline (a few seconds; "
        "-m 'not packaging' skips it)")
