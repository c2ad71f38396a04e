"""PinPrefix, UnpinPrefix and ListPins over real gRPC on loopback: the round trip, the stats,
events and metrics they show in, every bad input's status, mutual TLS's roles, and the
operator's CLI (tools.pin)."""

from __future__ import annotations

import itertools

import grpc
import pytest

from allocator_svc.core.allocator import Allocator, Limits
from allocator_svc.core.pool import PoolConfig
from allocator_svc.metrics import AllocatorCollector
from allocator_svc.service import METHOD_ROLES
from common.credentials import ROLE_TOKEN_ENV, InternalAuth, TlsFiles
from gateway.api.tenants import Tenancy
from pagedkv.allocator.v1 import allocator_pb2 as pb
from pagedkv.allocator.v1 import allocator_pb2_grpc
from tests.allocator.conftest import REPO_ROOT, ROLE_TOKENS, start_allocator, stop_process
from tools import pin as pin_tool
from tools.make_certs import make_certs

pytestmark = pytest.mark.e2e

GATEWAY_TOKEN = ROLE_TOKENS.token("gateway")  # what an operator's tools present
_ids = itertools.count()
SYSTEM = list(range(1, 9))  # two blocks of 4
CODES = grpc.StatusCode


def register(stub, num_blocks=40, caching=True):
    """A pool of its own; the allocator's default --max-pinned-fraction (0.1): budget 4."""
    return stub.RegisterPool(pb.RegisterPoolRequest(
        pool_id=f"pins-{next(_ids)}", num_blocks=num_blocks, block_size=4,
        model_fingerprint="tiny", executor_instance_id="inst-1",
        enable_prefix_caching=caching)).pool


def pin(stub, pool, tokens, name="sys", salt=""):
    return stub.PinPrefix(pb.PinPrefixRequest(pool_id=pool.pool_id, token_ids=tokens,
                                              cache_salt=salt, name=name))


def run_request(stub, pool, request_id, prompt):
    """Admit, commit and free a request: its full blocks are cached."""
    item = pb.StepItem(request_id=request_id, prompt_token_ids=prompt, num_tokens=len(prompt))
    stub.Step(pb.StepRequest(pool_id=pool.pool_id, epoch=pool.epoch, lease_id=stub.lease_id,
                             items=[item]))
    stub.Free(pb.FreeRequest(pool_id=pool.pool_id, epoch=pool.epoch, lease_id=stub.lease_id,
                             request_ids=[request_id],
                             commits=[pb.Commit(request_id=request_id,
                                                num_computed_tokens=len(prompt))]))


def stats(stub, pool):
    return stub.GetStats(pb.GetStatsRequest(pool_id=pool.pool_id)).pools[0]


def listed(stub, pool):
    return stub.ListPins(pb.ListPinsRequest(pool_id=pool.pool_id))


def event_kinds(stub, pool, include_pins):
    events = stub.GetEvents(pb.GetEventsRequest(pool_id=pool.pool_id,
                                                include_pin_events=include_pins)).events
    return [(e.seq, e.WhichOneof("event")) for e in events]


def expect(code, fn, request, match):
    with pytest.raises(grpc.RpcError) as info:
        fn(request)
    assert info.value.code() == code, info.value.details()
    assert match in info.value.details()


def test_pin_round_trip_with_stats_and_events(stub):
    # Pinned before traffic (2 pending); a request caches and frees SYSTEM + 1 block: the two
    # stay held (used, pinned, never free). Unpinned, every block is free, still cached.
    pool = register(stub)
    made = pin(stub, pool, [*SYSTEM, 9, 10])  # the partial tail is ignored
    assert made.created and made.pin.pin_id.startswith("pin-")
    assert (made.pin.num_blocks, made.pin.num_pinned_blocks, made.pin.num_pending_blocks,
            made.pin.num_tokens, made.pin.pool_id) == (2, 0, 2, 8, pool.pool_id)
    run_request(stub, pool, "a", [*SYSTEM, 9, 10, 11, 12, 13])
    s = stats(stub, pool)
    assert (s.num_pinned_blocks, s.num_pins, s.num_used_blocks, s.num_free_blocks) == (2, 1, 2, 38)
    pins = listed(stub, pool)
    assert (pins.pin_budget_blocks, pins.num_budget_blocks_used) == (4, 2)
    assert [(p.pin_id, p.num_pinned_blocks, p.num_pending_blocks) for p in pins.pins] == [
        (made.pin.pin_id, 2, 0)]
    # An observer that predates pins sees only stores; one that asks sees the pins too.
    assert event_kinds(stub, pool, False) == [(1, "stored"), (2, "stored"), (3, "stored")]
    assert event_kinds(stub, pool, True)[3:] == [(4, "pinned"), (5, "pinned")]
    unpinned = stub.UnpinPrefix(pb.UnpinPrefixRequest(pool_id=pool.pool_id,
                                                      pin_id=made.pin.pin_id))
    assert unpinned.num_released_blocks == 2 and unpinned.pin.num_pinned_blocks == 2
    assert event_kinds(stub, pool, True)[5:] == [(6, "unpinned"), (7, "unpinned")]
    s = stats(stub, pool)
    assert (s.num_pinned_blocks, s.num_pins, s.num_free_blocks, s.num_cached_blocks) == (
        0, 0, 40, 3)
    assert list(listed(stub, pool).pins) == []
    match = stub.MatchPrefix(pb.MatchPrefixRequest(token_ids=[*SYSTEM, 9, 10, 11, 12, 13],
                                                   pool_ids=[pool.pool_id]))
    assert match.matches[0].num_cached_tokens == 12  # revivable


def test_pin_again_under_the_same_name_is_the_same_pin(stub):
    pool = register(stub)
    first = pin(stub, pool, SYSTEM)
    again = pin(stub, pool, SYSTEM)
    assert not again.created and again.pin == first.pin


BAD_PINS = [
    # (what, request fields, code, message)
    ("unknown pool", {"pool_id": "no-such-pool"}, CODES.NOT_FOUND, "unknown pool 'no-such-pool'"),
    ("too short", {"token_ids": [1, 2, 3]}, CODES.INVALID_ARGUMENT,
     "a pin needs at least one full block: 3 token ids"),
    ("empty", {"token_ids": []}, CODES.INVALID_ARGUMENT, "at least one full block: 0 token ids"),
    ("negative id", {"token_ids": [1, 2, -7, 4]}, CODES.INVALID_ARGUMENT,
     "token ids must be >= 0, got -7"),
    ("too long", {"token_ids": list(range(20))}, CODES.RESOURCE_EXHAUSTED,
     "the prefix has 5 full blocks, more than the whole budget; 1 pins hold 2 of its 4 blocks"),
    ("over budget", {"token_ids": list(range(100, 112))}, CODES.RESOURCE_EXHAUSTED,
     "the prefix has 3 full blocks, 3 of them not pinned yet; 1 pins hold 2 of its 4 blocks"),
    ("another name", {"token_ids": SYSTEM, "name": "other"}, CODES.ALREADY_EXISTS,
     "this prefix is pinned in pool"),
    ("long salt", {"cache_salt": "s" * 300}, CODES.INVALID_ARGUMENT,
     "cache_salt has 300 characters"),
    ("long name", {"name": "n" * 300}, CODES.INVALID_ARGUMENT, "name has 300 characters"),
]


@pytest.mark.parametrize(("what", "fields", "code", "match"), BAD_PINS,
                         ids=[b[0] for b in BAD_PINS])
def test_pin_bad_input_gets_a_precise_status_and_changes_nothing(stub, what, fields, code,
                                                                 match):
    pool = register(stub)
    kept = pin(stub, pool, SYSTEM).pin
    before = (listed(stub, pool), stats(stub, pool))
    request = {"pool_id": pool.pool_id, "token_ids": [*SYSTEM, 9, 10, 11, 12], "name": "sys",
               **fields}
    expect(code, stub.PinPrefix, pb.PinPrefixRequest(**request), match)
    assert (listed(stub, pool), stats(stub, pool)) == before
    assert [p.pin_id for p in before[0].pins] == [kept.pin_id]


def test_pins_are_kept_across_a_pool_reset(stub):
    # A new executor instance resets the pool: the pin stays, under its id, all pending; a
    # reset to a pool whose budget (1 block) cannot hold it drops it.
    pool = register(stub)
    kept = pin(stub, pool, SYSTEM).pin
    run_request(stub, pool, "a", [*SYSTEM, 9])
    reset = stub.RegisterPool(pb.RegisterPoolRequest(
        pool_id=pool.pool_id, num_blocks=40, block_size=4, model_fingerprint="tiny",
        executor_instance_id="inst-2", enable_prefix_caching=True))
    assert reset.reset
    (after,) = listed(stub, reset.pool).pins
    assert (after.pin_id, after.num_pinned_blocks, after.num_pending_blocks) == (
        kept.pin_id, 0, 2)
    smaller = stub.RegisterPool(pb.RegisterPoolRequest(
        pool_id=pool.pool_id, num_blocks=10, block_size=4, model_fingerprint="tiny",
        executor_instance_id="inst-3", enable_prefix_caching=True))
    assert list(listed(stub, smaller.pool).pins) == []
    assert listed(stub, smaller.pool).pin_budget_blocks == 1


def test_pin_needs_prefix_caching(stub):
    pool = register(stub, caching=False)
    expect(CODES.FAILED_PRECONDITION, stub.PinPrefix,
           pb.PinPrefixRequest(pool_id=pool.pool_id, token_ids=SYSTEM),
           "runs without prefix caching")


def test_unpin_and_list_bad_input(stub):
    pool = register(stub)
    kept = pin(stub, pool, SYSTEM).pin
    expect(CODES.NOT_FOUND, stub.UnpinPrefix,
           pb.UnpinPrefixRequest(pool_id=pool.pool_id, pin_id="pin-0123"),
           "unknown pin 'pin-0123'")
    expect(CODES.INVALID_ARGUMENT, stub.UnpinPrefix,
           pb.UnpinPrefixRequest(pool_id=pool.pool_id), "pin_id is required")
    expect(CODES.NOT_FOUND, stub.UnpinPrefix,
           pb.UnpinPrefixRequest(pool_id="no-such-pool", pin_id=kept.pin_id), "unknown pool")
    expect(CODES.NOT_FOUND, stub.ListPins, pb.ListPinsRequest(pool_id="no-such-pool"),
           "unknown pool")
    assert [p.pin_id for p in listed(stub, pool).pins] == [kept.pin_id]


def test_every_allocator_method_is_for_gateways_alone():
    # The method table names every method of the service, each for the gateway role only
    # (its tokens' and, under mutual TLS, its certificates').
    assert {"PinPrefix", "UnpinPrefix", "ListPins"} <= set(METHOD_ROLES)
    assert set(METHOD_ROLES) == set(pb.DESCRIPTOR.services_by_name["AllocatorService"]
                                    .methods_by_name)
    assert set(METHOD_ROLES.values()) == {frozenset({"gateway"})}


def test_pin_metrics_per_pool():
    # The collector's gauges: pinned (held), pending, pins, budget.
    allocator = Allocator(Limits(max_pinned_fraction=0.25))
    allocator.register_pool(PoolConfig("p", 16, 4, 0, "fp", "i", True))
    allocator.pin_prefix("p", SYSTEM, "", "a")
    values = {m.name: m.samples[0].value for m in AllocatorCollector(allocator).collect()
              if m.samples and m.samples[0].labels.get("pool_id") == "p"}
    assert (values["pagedkv_allocator_blocks_pinned"],
            values["pagedkv_allocator_blocks_pinned_pending"],
            values["pagedkv_allocator_pins"],
            values["pagedkv_allocator_pin_budget_blocks"]) == (0, 2, 1, 4)


def test_pin_tool_pins_lists_and_unpins(stub, allocator_server, monkeypatch, capsys):
    # python -m tools.pin with the gateway's token from the environment, as operators run it.
    monkeypatch.setenv(ROLE_TOKEN_ENV, GATEWAY_TOKEN)
    pool = register(stub)
    base = ["--allocator-addr", allocator_server.address, "--pool", pool.pool_id]
    assert pin_tool.main([*base, "--token-ids", ",".join(map(str, SYSTEM)), "--name", "sp"]) == 0
    line = capsys.readouterr().out
    assert line.startswith("pinned pin-") and "blocks=2" in line and "pending=2" in line
    pin_id = line.split()[1]
    assert pin_tool.main([*base, "--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"pool {pool.pool_id}: 1 pins name 2 of a budget of 4 blocks"
    assert out[1].startswith(pin_id)
    everything = ["--allocator-addr", allocator_server.address, "--list"]
    assert pin_tool.main(everything) == 0  # every pool's pins, this one's among them
    out = capsys.readouterr().out.splitlines()
    assert out.index(f"pool {pool.pool_id}: 1 pins name 2 of a budget of 4 blocks") + 1 == (
        next(i for i, line in enumerate(out) if line.startswith(pin_id)))
    assert pin_tool.main(everything[:2] + ["--unpin", pin_id]) == 2
    assert "--pool is required" in capsys.readouterr().err
    assert pin_tool.main([*base, "--token-ids", "1,2"]) == 1
    assert "INVALID_ARGUMENT: a pin needs at least one full block" in capsys.readouterr().err
    assert pin_tool.main([*base, "--unpin", pin_id]) == 0
    assert capsys.readouterr().out.startswith(f"unpinned {pin_id}")
    assert pin_tool.main([*base, "--unpin", pin_id]) == 1
    assert f"NOT_FOUND: unknown pin '{pin_id}'" in capsys.readouterr().err
    assert pin_tool.main([*base, "--text", "hello"]) == 2  # no --model
    assert "--text and --system need --model" in capsys.readouterr().err


def test_pin_tool_tokenizes_text_as_the_gateway_does(stub, allocator_server, monkeypatch,
                                                     capsys):
    # --text: the gateway's tokenizer for a text prompt (tiny-llama's); only full blocks.
    from gateway.text.tokenizer import Tokenizer

    monkeypatch.setenv(ROLE_TOKEN_ENV, GATEWAY_TOKEN)
    model = str(REPO_ROOT / "models" / "tiny-llama")
    text = "You are a helpful assistant. Answer briefly and politely, in plain words."
    tokens = Tokenizer.load(model).encode(text)
    pool = register(stub, num_blocks=400)  # budget 40
    assert pin_tool.main(["--allocator-addr", allocator_server.address, "--pool", pool.pool_id,
                          "--text", text, "--model", model]) == 0
    assert f"blocks={len(tokens) // 4}\t" in capsys.readouterr().out
    # The same chain: pinned again from the token ids, it is the same pin.
    again = pin(stub, pool, tokens, name="")
    assert not again.created


def test_pin_tool_system_is_the_start_of_the_gateways_chat():
    # --system: a chat with that system message, as the gateway renders it (the embedded
    # model's template), starts with exactly the pinned tokens.
    from gateway.text.tokenizer import ChatTurn, Tokenizer

    model = str(REPO_ROOT / "models" / "smollm2-135m-instruct")
    system = "You are a helpful assistant who answers in French."
    pinned = pin_tool.token_ids(pin_tool.parse_args(
        ["--pool", "p", "--system", system, "--model", model]))
    chat = Tokenizer.load(model).render_chat([ChatTurn("system", system),
                                              ChatTurn("user", "Bonjour")])
    assert len(pinned) > 8 and chat[: len(pinned)] == pinned


def test_pin_tool_derives_a_tenants_salt_as_the_gateway_does(monkeypatch, tmp_path):
    secret = tmp_path / "salt-secret"
    secret.write_text("a-shared-salt-secret-0123456789")
    monkeypatch.setenv(ROLE_TOKEN_ENV, GATEWAY_TOKEN)
    args = pin_tool.parse_args(["--pool", "p", "--token-ids", "1", "--tenant", "acme",
                                "--cache-salt", "x", "--salt-secret-file", str(secret)])
    gateway = Tenancy({"key": "acme"}, secret.read_text().encode())
    assert pin_tool.cache_salt(args, InternalAuth(token=GATEWAY_TOKEN)) == gateway.cache_salt(
        "acme", "x")
    no_file = pin_tool.parse_args(["--pool", "p", "--token-ids", "1", "--tenant", "acme"])
    from_token = Tenancy({"key": "acme"}, b"pagedkv-tenant-salt:" + GATEWAY_TOKEN.encode())
    assert pin_tool.cache_salt(no_file, InternalAuth(token=GATEWAY_TOKEN)) == (
        from_token.cache_salt("acme", ""))


def test_pins_answer_only_gateway_certificates_under_mutual_tls(tmp_path, monkeypatch):
    # An executor's certificate may not pin; a gateway's (the operator's tool) may.
    monkeypatch.setenv(ROLE_TOKEN_ENV, GATEWAY_TOKEN)
    certs = tmp_path / "certs"
    make_certs(certs, [])
    server = start_allocator(tmp_path, "--tls-cert", str(certs / "allocator.pem"),
                             "--tls-key", str(certs / "allocator-key.pem"),
                             "--tls-ca", str(certs / "ca.pem"), "--metrics-port", "-1")
    try:
        def as_role(role: str) -> InternalAuth:
            return ROLE_TOKENS.auth(role, TlsFiles(str(certs / f"{role}.pem"),
                                                   str(certs / f"{role}-key.pem"),
                                                   str(certs / "ca.pem")))

        with as_role("executor").channel(server.address) as channel:
            with pytest.raises(grpc.RpcError) as info:
                allocator_pb2_grpc.AllocatorServiceStub(channel).PinPrefix(
                    pb.PinPrefixRequest(pool_id="p", token_ids=SYSTEM), timeout=5)
        assert info.value.code() == CODES.PERMISSION_DENIED
        assert "may not call PinPrefix" in info.value.details()
        tls = ["--tls-cert", str(certs / "gateway.pem"), "--tls-key",
               str(certs / "gateway-key.pem"), "--tls-ca", str(certs / "ca.pem")]
        args = pin_tool.parse_args(["--allocator-addr", server.address, "--pool", "p",
                                    "--list", *tls])
        with pytest.raises(grpc.RpcError) as info:  # the call passes; the pool is unknown
            pin_tool.run(args, pin_tool.internal_auth_from_args(args))
        assert info.value.code() == CODES.NOT_FOUND
    finally:
        assert stop_process(server) == 0
