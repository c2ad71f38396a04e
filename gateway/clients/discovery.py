"""Where the executors are: a static list, a DNS name, or a file, asked again every few seconds
by the gateway's membership loop (engine/membership.py).

- `--executor-addrs a:1,b:2`: fixed for the gateway's life.
- `--executor-dns name:port`: every address the name resolves to (a Kubernetes headless
  Service has one A record per ready executor pod), each with the port.
- `--executor-addrs-file PATH`: `host:port` entries, one per line or comma-separated, `#`
  comments; rewritten by whatever keeps the list (a config-management agent, a script).

A lookup that fails keeps the executors the gateway has (a DNS hiccup must not drain a fleet):
it raises DiscoveryFailed, which the membership loop logs with the reason.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from common.config import SettingsError


class DiscoveryFailed(Exception):
    """The executors could not be listed this time (the message says why)."""


class Discovery(Protocol):
    @property
    def source(self) -> str: ...

    @property
    def dynamic(self) -> bool: ...

    async def addresses(self) -> list[str]: ...


def parse_addresses(text: str) -> list[str]:
    """`host:port` entries, comma- or line-separated, `#` to the end of a line a comment;
    in order, without repeats."""
    entries = []
    for line in text.splitlines():
        entries += [e.strip() for e in line.split("#", 1)[0].split(",") if e.strip()]
    return list(dict.fromkeys(entries))


@dataclass(frozen=True, slots=True)
class StaticAddresses:
    addrs: tuple[str, ...]

    @property
    def source(self) -> str:
        return "--executor-addrs"

    @property
    def dynamic(self) -> bool:
        return False

    async def addresses(self) -> list[str]:
        return list(self.addrs)


Resolver = Callable[[str, int], Awaitable[list[str]]]


async def _getaddrinfo(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    found = []
    for *_, sockaddr in infos:
        ip = str(sockaddr[0])
        found.append(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")
    return found


@dataclass(frozen=True, slots=True)
class DnsAddresses:
    host: str
    port: int
    resolve: Resolver = _getaddrinfo

    @property
    def source(self) -> str:
        return f"--executor-dns {self.host}:{self.port}"

    @property
    def dynamic(self) -> bool:
        return True

    async def addresses(self) -> list[str]:
        try:
            found = await self.resolve(self.host, self.port)
        except OSError as exc:
            raise DiscoveryFailed(f"{self.host} does not resolve: {exc}") from exc
        return sorted(set(found))


@dataclass(frozen=True, slots=True)
class FileAddresses:
    path: str

    @property
    def source(self) -> str:
        return f"--executor-addrs-file {self.path}"

    @property
    def dynamic(self) -> bool:
        return True

    async def addresses(self) -> list[str]:
        try:
            return parse_addresses(Path(self.path).read_text())
        except OSError as exc:
            raise DiscoveryFailed(f"cannot read {self.path}: {exc.strerror}") from exc


def split_host_port(value: str, flag: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SettingsError(f"{flag} {value!r}: expected host:port")
    return host.strip("[]"), int(port)
