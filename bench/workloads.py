"""Synthetic request lengths shaped like the PagedAttention paper's traces (no download).

Each dimension is log-normal, fitted to the published means with a documented spread:
mean = exp(mu + sigma^2 / 2), so mu = ln(mean) - sigma^2 / 2. Lengths are clipped to
[1, max_len] and a request's prompt + output to max_len. Fixed seeds make runs comparable.

    ShareGPT-like: input mean 161 (sigma 1.0), output mean 338 (sigma 0.9): long, heavy tail
    Alpaca-like:   input mean 19  (sigma 0.6), output mean 58  (sigma 0.7): short
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LengthModel:
    name: str
    input_mean: float
    input_sigma: float
    output_mean: float
    output_sigma: float


SHAREGPT = LengthModel("sharegpt", 161, 1.0, 338, 0.9)
ALPACA = LengthModel("alpaca", 19, 0.6, 58, 0.7)


@dataclass(frozen=True, slots=True)
class RequestLengths:
    prompt_len: int
    output_len: int


def _lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)


def sample_lengths(
    model: LengthModel, count: int, max_len: int, seed: int = 0
) -> list[RequestLengths]:
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        prompt = min(
            max_len - 1, max(1, round(_lognormal(rng, model.input_mean, model.input_sigma)))
        )
        output = min(
            max_len - prompt, max(1, round(_lognormal(rng, model.output_mean, model.output_sigma)))
        )
        requests.append(RequestLengths(prompt, output))
    return requests


def bounded_lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    """A log-normal length around `median`, clipped to [low, high] (serving benchmarks)."""
    return min(high, max(low, round(rng.lognormvariate(math.log(median), sigma))))
