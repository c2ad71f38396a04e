"""The beam-search benchmark's block counts, read from an allocator recording: each search's
Steps, its blocks in use (shared) against its beams' own copies (unshared)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.beam_search import SearchSteps, recorded_searches, tally

HEADER = ('{"format":"pagedkv-allocations","version":1,"created_unix":0.0,'
          '"hash_profile":"pagedkv-block-hash-v1","hash_prefix_bytes":8,"token_ids":false}')
POOL = ('{"k":"pool","t":0.0,"pool":"pool-0","num_blocks":64,"block_size":4,'
        '"num_cpu_blocks":0,"prefix_caching":true,"reset":false}')


def write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "allocations.jsonl"
    path.write_text("\n".join((HEADER, POOL, *lines)) + "\n")
    return path


def test_recorded_searches_split_at_each_admission_and_skip_other_records(tmp_path: Path):
    # A warm-up search of 2 steps, then one of 3 (prompt 6, width 2): Free and Fork lines
    # and the stop record are not Steps.
    path = write(
        tmp_path,
        '{"k":"step","t":0.1,"pool":0,"rows":1,"used":1,"tokens":3,"admit":[["w",3,0,0]]}',
        '{"k":"fork","t":0.1,"pool":0,"parent":"w","num_tokens":3,"children":["w-1"]}',
        '{"k":"step","t":0.2,"pool":0,"rows":2,"used":2}',
        '{"k":"free","t":0.3,"pool":0,"end":[["w","f",4,""]]}',
        '{"k":"step","t":0.4,"pool":0,"rows":1,"used":2,"tokens":6,"admit":[["s",6,0,0]]}',
        '{"k":"step","t":0.5,"pool":0,"rows":2,"used":3}',
        '{"k":"step","t":0.6,"pool":0,"rows":2,"used":4}',
        '{"k":"stop","t":0.7,"reason":"shutdown","live":[]}',
    )
    assert recorded_searches(path) == [SearchSteps(3, (1, 2), (1, 2)),
                                       SearchSteps(6, (1, 2, 2), (2, 3, 4))]


def test_tally_counts_blocks_in_use_against_each_beams_own_table():
    # Prompt 6, block 4: step 1 one beam of 6 tokens (2 blocks), step 2 two beams of 7 (2
    # each), step 3 two beams of 8 (2 each), step 4 three beams of 9 (3 each).
    steps = SearchSteps(6, (1, 2, 2, 3), (2, 3, 4, 6))
    assert steps.unshared(4) == [2, 4, 4, 9]
    assert tally(steps, 4) == {"num_steps": 4, "peak_blocks": 6, "peak_blocks_unshared": 9,
                               "sum_blocks": 15, "sum_blocks_unshared": 19}


@pytest.mark.parametrize("line", [
    '{"k":"step","t":0.2,"pool":0,"rows":2,"used":2,"pre":[["s","recompute"]]}',
    '{"k":"step","t":0.2,"pool":0,"rows":2,"used":2,"wait":["t"]}',
    '{"k":"step","t":0.2,"pool":0,"rows":2,"used":2,"admit":[["s",6,0,0],["t",5,0,0]]}',
])
def test_recorded_searches_refuse_steps_that_are_not_one_search_alone(tmp_path: Path, line: str):
    # A preemption, a deferral or a second admission: the pool's count is not one search's.
    path = write(tmp_path,
                 '{"k":"step","t":0.1,"pool":0,"rows":1,"used":2,"admit":[["s",6,0,0]]}', line)
    with pytest.raises(AssertionError):
        recorded_searches(path)
