"""bench.allocation_replay's servicer timing drives the real servicer and recorder: a change to
their hooks must not leave the benchmark calling them the old way."""

from __future__ import annotations

from bench.allocation_replay import servicer_step_us


def test_the_servicer_timing_runs_with_and_without_a_recording():
    # 64 steps: one of them churns (a quarter freed, as many admitted).
    for recording in (False, True):
        decode_us, churn_us, own_decode_us, own_churn_us = servicer_step_us(
            8, recording=recording, steps=64)
        assert decode_us > 0 and churn_us > 0
        assert (own_decode_us > 0) == recording and (own_churn_us > 0) == recording
