"""A multi-tenant shared-prefix workload for the fleet benchmark (no download).

Several tenants, each with a few long system prompts shared by many of its requests; every
request is one system prompt followed by a suffix of its own, and asks for a fixed number of
new tokens (greedy, `ignore_eos`). Popularity is skewed, as in production traffic: tenants
and, within a tenant, its system prompts are drawn with Zipf weights (1 / rank^s), so a few
prefixes are hot and the rest are a long tail. Lengths are log-normal around a median and
clipped. Token ids are uniform over [TOKEN_LOW, vocab_size): system prompts are distinct and
a suffix almost surely shares no block with another, so every cache hit is a system prompt's.
Tenants are isolated by API key (the gateway salts their blocks apart); their prompts do not
overlap anyway. Everything is drawn from one seed: the same seed, the same requests.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice

from bench.workloads import bounded_lognormal

TOKEN_LOW = 16  # clear of the special ids at the bottom of a vocabulary


@dataclass(frozen=True, slots=True)
class TenantMix:
    num_tenants: int = 8
    prompts_per_tenant: int = 4
    system_median: int = 1024  # tokens; log-normal sigma 0.4, clipped to [256, 2048]
    suffix_median: int = 64  # log-normal sigma 0.8, clipped to [8, 512]
    output_median: int = 32  # log-normal sigma 0.6, clipped to [4, 128]
    tenant_zipf: float = 1.0
    prompt_zipf: float = 1.0

    @property
    def num_system_prompts(self) -> int:
        return self.num_tenants * self.prompts_per_tenant


@dataclass(frozen=True, slots=True)
class FleetRequest:
    tenant: int
    system_prompt: int  # its index within the tenant's prompts
    system: tuple[int, ...]  # the shared part (one tuple per system prompt, not copied)
    suffix: tuple[int, ...]  # this request's own
    output_len: int

    @property
    def prompt(self) -> list[int]:
        return [*self.system, *self.suffix]


def zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (rank ** s) for rank in range(1, n + 1)]


def system_prompts(mix: TenantMix, vocab_size: int, seed: int) -> list[list[tuple[int, ...]]]:
    """[tenant][prompt] -> its token ids."""
    rng = random.Random(f"system-{seed}")
    return [[tuple(rng.randrange(TOKEN_LOW, vocab_size)
                   for _ in range(bounded_lognormal(rng, mix.system_median, 0.4, 256, 2048)))
             for _ in range(mix.prompts_per_tenant)]
            for _ in range(mix.num_tenants)]


def iter_requests(mix: TenantMix, vocab_size: int, seed: int = 0) -> Iterator[FleetRequest]:
    """An endless stream of requests; the same seed, the same stream."""
    systems = system_prompts(mix, vocab_size, seed)
    rng = random.Random(f"requests-{seed}")
    tenant_weights = zipf_weights(mix.num_tenants, mix.tenant_zipf)
    prompt_weights = zipf_weights(mix.prompts_per_tenant, mix.prompt_zipf)
    while True:
        tenant = rng.choices(range(mix.num_tenants), tenant_weights)[0]
        index = rng.choices(range(mix.prompts_per_tenant), prompt_weights)[0]
        suffix_len = bounded_lognormal(rng, mix.suffix_median, 0.8, 8, 512)
        yield FleetRequest(
            tenant=tenant, system_prompt=index, system=systems[tenant][index],
            suffix=tuple(rng.randrange(TOKEN_LOW, vocab_size) for _ in range(suffix_len)),
            output_len=bounded_lognormal(rng, mix.output_median, 0.6, 4, 128))


def fleet_requests(mix: TenantMix, count: int, vocab_size: int,
                   seed: int = 0) -> list[FleetRequest]:
    return list(islice(iter_requests(mix, vocab_size, seed), count))
