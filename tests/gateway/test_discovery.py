"""Executor discovery (gateway/clients/discovery.py) and the membership loop that follows it
(gateway/engine/membership.py), with fake engines; the whole stack is tested in
tests/e2e/test_discovery_e2e.py."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from common.executor_description import ExecutorDescription
from gateway.api.sampling import ModelLimits
from gateway.app import Fleet
from gateway.clients.discovery import (
    DiscoveryFailed,
    DnsAddresses,
    FileAddresses,
    parse_addresses,
    split_host_port,
)
from gateway.engine.membership import Membership


def test_address_lists_take_lines_commas_and_comments():
    text = "a:1, b:2\n# all of this is a comment\nc:3 # and this\n\na:1\n"
    assert parse_addresses(text) == ["a:1", "b:2", "c:3"]


def test_host_port_is_checked():
    assert split_host_port("executor.ns.svc:50053", "--executor-dns") == (
        "executor.ns.svc", 50053)
    assert split_host_port("[::1]:7", "--x") == ("::1", 7)
    for bad in ("executor", "executor:", ":50053", "executor:99999", "executor:x"):
        with pytest.raises(ValueError, match="expected host:port"):
            split_host_port(bad, "--executor-dns")


def test_dns_lists_every_address_with_the_port():
    async def resolve(host: str, port: int) -> list[str]:
        assert (host, port) == ("executor.ns.svc", 50053)
        return ["10.0.0.2:50053", "10.0.0.1:50053", "10.0.0.2:50053"]

    found = DnsAddresses("executor.ns.svc", 50053, resolve)
    assert asyncio.run(found.addresses()) == ["10.0.0.1:50053", "10.0.0.2:50053"]


def test_dns_failure_and_a_missing_file_say_why():
    async def nxdomain(host: str, port: int) -> list[str]:
        raise OSError("Name or service not known")

    with pytest.raises(DiscoveryFailed, match="does not resolve: Name or service not known"):
        asyncio.run(DnsAddresses("nowhere", 1, nxdomain).addresses())
    with pytest.raises(DiscoveryFailed, match="cannot read"):
        asyncio.run(FileAddresses("/nonexistent/executors.txt").addresses())


def test_real_dns_resolves_localhost():
    # The system resolver, as in a pod (a headless Service resolves to its pods).
    found = asyncio.run(DnsAddresses("localhost", 50053).addresses())
    assert "127.0.0.1:50053" in found


@dataclass(eq=False)
class FakeEngine:
    address: str
    busy: bool = False
    healthy: bool = True
    draining: bool = False
    closed: bool = False
    link: SimpleNamespace = field(init=False)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        async def close() -> None:
            self.closed = True

        self.link = SimpleNamespace(executor=SimpleNamespace(address=self.address, close=close))

    @property
    def pool_id(self) -> str:
        return self.address

    @property
    def load(self) -> int:
        return int(self.busy)

    async def run(self) -> None:
        await asyncio.Event().wait()


@dataclass
class FakeRouter:
    engines: list[FakeEngine] = field(default_factory=list)
    moved_waiting_from: list[FakeEngine] = field(default_factory=list)

    def move_waiting(self, engine: FakeEngine) -> int:
        self.moved_waiting_from.append(engine)
        return 0

    def add(self, engine: FakeEngine) -> None:
        self.engines = [*self.engines, engine]

    def remove(self, engine: FakeEngine) -> None:
        self.engines = [e for e in self.engines if e is not engine]


class ListedAddresses:
    source, dynamic = "test", True

    def __init__(self) -> None:
        self.listed: list[str] | Exception = []

    async def addresses(self) -> list[str]:
        if isinstance(self.listed, Exception):
            raise self.listed
        return list(self.listed)


def test_membership_follows_joins_and_drains_leavers(tmp_path: Path):
    async def scenario() -> None:
        listed, router = ListedAddresses(), FakeRouter()
        refused = {"other-model:1"}

        async def join(address: str) -> FakeEngine | None:
            if address in refused:
                return None
            engine = FakeEngine(address)
            router.add(engine)
            return engine

        membership = Membership(listed, router, join, interval_s=0.01)  # type: ignore[arg-type]
        listed.listed = ["a:1", "b:2", "other-model:1"]
        await membership.refresh()
        assert [e.address for e in router.engines] == ["a:1", "b:2"]
        b = router.engines[1]
        b.busy = True
        listed.listed = ["a:1"]
        await membership.refresh()
        await asyncio.sleep(0.3)
        assert b.draining and b in router.engines and not b.closed  # its requests finish
        assert router.moved_waiting_from == [b]  # (or move: the router's, tested apart)
        b.busy = False
        await asyncio.sleep(0.3)
        assert [e.address for e in router.engines] == ["a:1"] and b.closed
        listed.listed = DiscoveryFailed("a DNS hiccup")
        await membership.refresh()  # changes nothing
        assert [e.address for e in router.engines] == ["a:1"]
        assert "a DNS hiccup" in membership.last_problem
        listed.listed = []  # a file read between its truncation and its write
        await membership.refresh()  # changes nothing either
        assert [e.address for e in router.engines] == ["a:1"] and not router.engines[0].draining
        assert "lists no executor" in membership.last_problem
        listed.listed = ["a:1", "b:2"]  # the executor that left joins again: a new engine
        await membership.refresh()
        assert [e.address for e in router.engines] == ["a:1", "b:2"]
        assert router.engines[1] is not b
        await membership.close()

    asyncio.run(scenario())


def test_a_joining_executor_must_meet_the_limits_requests_were_admitted_under():
    # Requests admitted under the limits of the executors found at start may be routed to
    # any executor: one that joins later and falls short of them is refused, saying why.
    limits = ModelLimits(max_model_len=512, vocab_size=100, max_n=4,
                         pool_capacity_tokens=1024, structured_output=True)
    fleet = Fleet(settings=None, shards=None, finish_rules=None, router=None,  # type: ignore
                  metrics=None, model_fingerprint="abc", limits=limits)
    fits = ExecutorDescription(
        instance_id="i", model_name="m", model_fingerprint="abc", num_blocks=64, block_size=16,
        num_cpu_blocks=0, backend="torch", device="cpu", max_model_len=512, eos_token_ids=(2,),
        vocab_size=100, max_num_batched_tokens=256, max_num_seqs=8, structured_output=True)
    assert fleet.refusal(fits) == ""
    assert fleet.refusal(replace(fits, max_model_len=0)) == ""  # reports none: no limit
    for short, why in (
        (replace(fits, model_fingerprint="xyz"), "serves another model"),
        (replace(fits, structured_output=False), "cannot apply structured output"),
        (replace(fits, max_model_len=256), "max_model_len 256 is below the 512"),
        (replace(fits, num_blocks=32), "holds 512 tokens, below the 1024"),
    ):
        assert why in fleet.refusal(short)
    fleet.limits = replace(limits, structured_output=False)  # no one applies it: not needed
    assert fleet.refusal(replace(fits, structured_output=False)) == ""
