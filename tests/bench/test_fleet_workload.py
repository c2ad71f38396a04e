"""The fleet benchmark's workload: shared system prompts per tenant, unique suffixes, skewed
popularity, the same requests from the same seed."""

from __future__ import annotations

from collections import Counter

from bench.fleet_workload import TOKEN_LOW, TenantMix, fleet_requests, system_prompts

MIX = TenantMix(num_tenants=4, prompts_per_tenant=3)
VOCAB = 32000


def test_fleet_workload_requests_start_with_their_tenants_system_prompt() -> None:
    # Every prompt is one of its own tenant's system prompts, then its own suffix.
    systems = system_prompts(MIX, VOCAB, seed=3)
    for r in fleet_requests(MIX, 300, VOCAB, seed=3):
        assert r.system == systems[r.tenant][r.system_prompt]
        assert r.prompt == [*r.system, *r.suffix]
        assert 256 <= len(r.system) <= 2048 and 8 <= len(r.suffix) <= 512
        assert 4 <= r.output_len <= 128
        assert all(TOKEN_LOW <= t < VOCAB for t in r.prompt)


def test_fleet_workload_system_prompts_are_distinct_and_suffixes_unique() -> None:
    # 12 system prompts, no two alike; no two requests' suffixes alike.
    systems = [p for tenant in system_prompts(MIX, VOCAB, seed=0) for p in tenant]
    assert len(systems) == MIX.num_system_prompts == len(set(systems))
    requests = fleet_requests(MIX, 500, VOCAB)
    assert len({r.suffix for r in requests}) == len(requests)


def test_fleet_workload_popularity_is_skewed_towards_the_first_ranks() -> None:
    # Zipf weights: tenant 0 is the most frequent, and its prompt 0 its most frequent.
    requests = fleet_requests(MIX, 4000, VOCAB, seed=1)
    tenants = Counter(r.tenant for r in requests)
    assert tenants.most_common(1)[0][0] == 0 and tenants[0] > 2 * tenants[3]
    prompts = Counter(r.system_prompt for r in requests if r.tenant == 0)
    assert prompts.most_common(1)[0][0] == 0


def test_fleet_workload_same_seed_same_requests() -> None:
    # Every policy of a run serves this same stream; another seed, another stream.
    assert fleet_requests(MIX, 50, VOCAB, seed=7) == fleet_requests(MIX, 50, VOCAB, seed=7)
    assert fleet_requests(MIX, 50, VOCAB, seed=7) != fleet_requests(MIX, 50, VOCAB, seed=8)
