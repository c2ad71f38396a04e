"""How long a replayed step takes: a linear model of the batch, fitted to the recorded run.

A fixed step time would get the load wrong: a busy executor's steps are longer, so requests
stay longer and more of them run at once (on the recorded CPU stack, from 14 ms at one to
three requests to over 100 ms at 70). Each recorded Step is followed by the next after a gap;
a gap under BUSY_GAP_S is a busy step's time. Fitted by least squares:

    seconds = base + per_row * rows + per_token * (tokens - rows)

rows: the requests in the step; tokens: the tokens it computes (a decode is one; a prefill
chunk many). The gap after Step k is taken as step k's time (at depth 2 it is the batch
before's, which is much the same batch). A coefficient that comes out negative is dropped and
the rest fitted again; with too few steps, the median gap alone.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

MIN_SAMPLES = 16


@dataclass(frozen=True, slots=True)
class StepTime:
    base_s: float
    per_row_s: float = 0.0
    per_token_s: float = 0.0

    def seconds(self, rows: int, tokens: int) -> float:
        return self.base_s + self.per_row_s * rows + self.per_token_s * (tokens - rows)

    def describe(self) -> str:
        return (f"{1e3 * self.base_s:.2f} ms + {1e3 * self.per_row_s:.3f} ms/request + "
                f"{1e3 * self.per_token_s:.4f} ms/prefill token")


def fit(samples: list[tuple[int, int, float]], default_s: float) -> StepTime:
    """`samples`: (rows, tokens, gap seconds) of the busy steps."""
    if len(samples) < MIN_SAMPLES:
        return StepTime(statistics.median(g for _, _, g in samples) if samples else default_s)
    for columns in ((0, 1, 2), (0, 1), (0,)):
        coefficients = _least_squares(samples, columns)
        if coefficients is not None and all(c >= 0 for c in coefficients):
            full = [0.0, 0.0, 0.0]
            for column, value in zip(columns, coefficients, strict=True):
                full[column] = value
            return StepTime(*full)
    return StepTime(statistics.median(g for _, _, g in samples))


def _least_squares(samples: list[tuple[int, int, float]],
                   columns: tuple[int, ...]) -> list[float] | None:
    """Normal equations, solved by Gaussian elimination; None if singular."""
    n = len(columns)
    a = [[0.0] * n for _ in range(n)]
    b = [0.0] * n
    for rows, tokens, gap in samples:
        x = (1.0, float(rows), float(tokens - rows))
        xs = [x[c] for c in columns]
        for i in range(n):
            b[i] += xs[i] * gap
            for j in range(n):
                a[i][j] += xs[i] * xs[j]
    for i in range(n):
        pivot = max(range(i, n), key=lambda r: abs(a[r][i]))
        if abs(a[pivot][i]) < 1e-12:
            return None
        a[i], a[pivot], b[i], b[pivot] = a[pivot], a[i], b[pivot], b[i]
        for r in range(i + 1, n):
            factor = a[r][i] / a[i][i]
            for c in range(i, n):
                a[r][c] -= factor * a[i][c]
            b[r] -= factor * b[i]
    solution = [0.0] * n
    for i in reversed(range(n)):
        solution[i] = (b[i] - sum(a[i][c] * solution[c] for c in range(i + 1, n))) / a[i][i]
    return solution
