"""Beam search as plain values (gateway/core/beam_search.py): selection, forks and prunes,
finished hypotheses, early stopping; and token-for-token parity with transformers'
generate(num_beams=k) when driven by the same model's log-probabilities."""

from __future__ import annotations

import itertools
import math
import struct
import sys
from pathlib import Path

import pytest
import torch

from gateway.core.beam_search import BeamConfig, BeamSearch, EarlyStopping, f32

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

EOS = 2


def config(width: int = 2, n: int = 2, max_tokens: int = 8,
           stops: frozenset[int] = frozenset({EOS}), length_penalty: float = 1.0,
           early_stopping: EarlyStopping = EarlyStopping.HEURISTIC) -> BeamConfig:
    return BeamConfig(width, n, max_tokens, stops, length_penalty, early_stopping)


def names() -> itertools.count[int]:
    return itertools.count(1)


def test_f32_rounds_like_torch_float32():
    # An addition and a division of float32 values, done in float64 then rounded, are
    # torch's float32 results exactly.
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(2000, generator=gen) * 30
    b = torch.randn(2000, generator=gen) - 6
    for x, y, s, q in zip(a.tolist(), b.tolist(), (a + b).tolist(), (a / 7.3).tolist(),
                          strict=True):
        assert f32(x + y) == s
        assert f32(x / f32(7.3)) == q
    assert f32(0.1) == struct.unpack("f", struct.pack("f", 0.1))[0]


def test_num_candidates_keeps_enough_beams_that_do_not_end():
    # transformers' beams_to_keep: max(2, 1 + number of stop tokens) x width.
    assert config(width=3).num_candidates == 6
    assert config(width=3, stops=frozenset({2, 5, 9})).num_candidates == 12
    assert config(width=4, stops=frozenset()).num_candidates == 8


def test_first_step_forks_the_prompt_beam_into_the_best_continuations():
    # One beam (the prompt) with candidates 7 > 4 > 9 > 3: width 3 keeps 7, 4, 9; the
    # prompt beam continues with 7 and forks twice.
    search = BeamSearch.start(config(width=3, n=1), "b0")
    children = iter(["b1", "b2"])
    selection = search.select([[(7, -0.5), (4, -1.0), (9, -1.5), (3, -2.0), (5, -3.0),
                                (6, -4.0)]], lambda parent: next(children))
    assert selection.forks == [("b0", ["b1", "b2"])]
    assert selection.appends == [("b0", 7), ("b1", 4), ("b2", 9)]
    assert selection.pruned == [] and not selection.done
    assert [(b.handle, b.token_ids, b.score) for b in search.running] == [
        ("b0", [7], -0.5), ("b1", [4], -1.0), ("b2", [9], -1.5)]


def test_a_beam_without_continuations_is_pruned_and_scores_accumulate_in_float32():
    # Beam a (score -0.1) wins both places; beam b has none and is pruned.
    search = BeamSearch.start(config(width=2, n=1), "a")
    search.select([[(5, -0.1), (6, -0.2), (7, -3.0), (8, -4.0)]], lambda p: "b")
    children = iter(["c"])
    selection = search.select(
        [[(1, -0.3), (3, -0.4), (4, -5.0), (9, -6.0)],   # a: -0.4, -0.5
         [(1, -1.0), (3, -2.0), (4, -5.0), (9, -6.0)]],  # b: -1.2, -2.2
        lambda parent: next(children))
    assert selection.forks == [("a", ["c"])] and selection.pruned == ["b"]
    assert selection.appends == [("a", 1), ("c", 3)]
    assert [b.score for b in search.running] == [f32(f32(-0.1) + f32(-0.3)),
                                                 f32(f32(-0.1) + f32(-0.4))]


def test_eos_in_the_top_width_finishes_a_hypothesis_and_the_next_candidate_runs():
    # EOS is the best candidate: a finished hypothesis (score / 1 ** 1), and the two best
    # that did not end run on; lower-ranked EOS candidates (outside the top width) are not kept.
    search = BeamSearch.start(config(width=2, n=2), "a")
    selection = search.select([[(EOS, -0.1), (5, -0.2), (6, -0.3), (7, -4.0)]],
                              lambda parent: "b")
    assert selection.appends == [("a", 5), ("b", 6)]
    assert [(h.token_ids, h.score, h.stopped) for h in search.finished] == [((EOS,), f32(-0.1),
                                                                            True)]


def test_max_tokens_ends_the_search_with_the_best_hypotheses_in_order():
    # max_tokens 1: every candidate ends; the best width of them are the hypotheses, and
    # every running beam is freed.
    search = BeamSearch.start(config(width=2, n=2, max_tokens=1), "a")
    selection = search.select([[(5, -0.2), (6, -0.3), (7, -0.4), (8, -4.0)]], lambda p: "x")
    assert selection.done and selection.pruned == ["a"] and selection.appends == []
    assert [(h.token_ids, h.stopped) for h in search.results()] == [((5,), False), ((6,), False)]


@pytest.mark.parametrize(("early_stopping", "steps"), [
    (EarlyStopping.WHEN_FULL, 2),  # two hypotheses finished after step 2: stop
    (EarlyStopping.HEURISTIC, 3),  # the best running beam, at its length, cannot win at 3
    (EarlyStopping.NEVER, 6),      # ... nor at max_tokens (6) with length_penalty 2: run on
])
def test_early_stopping_modes_stop_when_transformers_does(early_stopping: EarlyStopping,
                                                          steps: int):
    # length_penalty 2. Step 1: (EOS,) finishes at -0.1. Step 2: (5, EOS) at -0.25 / 4;
    # running beams at -0.26 and -0.27 (the heuristic: -0.26 / 4 > -0.1, go on). From step 3
    # every token costs 1.0: -1.26 / 9 < -0.1 stops HEURISTIC; NEVER divides by 6 ** 2.
    search = BeamSearch.start(config(width=2, n=2, max_tokens=6, length_penalty=2.0,
                                     early_stopping=early_stopping), "a")
    spawn = names()
    lists = [[(EOS, -0.1), (5, -0.2), (6, -0.3), (7, -4.0)],
             [(EOS, -0.05), (5, -0.06), (6, -0.07), (7, -4.0)]]
    later = [(EOS, -2.0), (5, -1.0), (6, -1.1), (7, -4.0)]
    count = 0
    while not search.done:
        candidates = lists[count] if count < len(lists) else later
        search.select([candidates] * len(search.running), lambda p: next(spawn))
        count += 1
    assert count == steps
    assert search.results()[0].token_ids == (5, EOS)  # -0.0625: the best in every mode


def test_length_penalty_divides_by_generated_tokens_to_its_power():
    # Two EOS hypotheses: ((5, EOS), -0.9) over 2 tokens and ((EOS,), -0.6) over 1; with
    # length_penalty 2 the longer one wins (-0.225 > -0.6); with 0, the shorter one.
    for length_penalty, best in ((2.0, (5, EOS)), (0.0, (EOS,))):
        search = BeamSearch.start(config(width=2, n=1, max_tokens=2,
                                         length_penalty=length_penalty), "a")
        search.select([[(EOS, -0.6), (5, -0.7), (6, -0.8), (7, -5.0)]], lambda p: "b")
        search.select([[(EOS, -0.2), (8, -3.0), (9, -3.1), (10, -3.2)],
                       [(EOS, -0.9), (8, -3.0), (9, -3.1), (10, -3.2)]], lambda p: "c")
        assert search.done and search.results()[0].token_ids == best


def test_ties_go_to_the_lower_beam_then_the_lower_token():
    # Equal scores: the first beam's candidate first, then the lower token id.
    search = BeamSearch.start(config(width=2, n=2), "a")
    search.select([[(5, -1.0), (6, -1.0), (7, -2.0), (8, -2.0)]], lambda p: "b")
    assert [b.token_ids for b in search.running] == [[5], [6]]


# Parity with transformers, on the tiny-llama preset's dummy weights (tests/e2e/e2e_stack.py).
CASES = [
    (2, 2, 1.0, False), (3, 2, 0.5, True), (4, 3, 2.0, "never"), (4, 4, -1.0, False),
    (3, 1, 1.0, "never"), (2, 1, 0.0, True),
]
EARLY = {False: EarlyStopping.HEURISTIC, True: EarlyStopping.WHEN_FULL,
         "never": EarlyStopping.NEVER}


def _ours(model: torch.nn.Module, prompt: list[int], cfg: BeamConfig) -> list[tuple[int, ...]]:
    search = BeamSearch.start(cfg, 0)
    spawn = names()
    while not search.done:
        candidates = []
        for beam in search.running:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + beam.token_ids])).logits[0, -1].float()
            values, ids = torch.topk(torch.log_softmax(logits, -1), cfg.num_candidates)
            candidates.append(list(zip(ids.tolist(), values.tolist(), strict=True)))
        search.select(candidates, lambda parent: next(spawn))
    return [h.token_ids for h in search.results()]


def _theirs(model: torch.nn.Module, prompt: list[int], cfg: BeamConfig, early: bool | str
            ) -> list[tuple[int, ...]]:
    from transformers import GenerationConfig
    generation = GenerationConfig(
        max_new_tokens=cfg.max_tokens, do_sample=False, num_beams=cfg.beam_width,
        num_return_sequences=cfg.num_return, length_penalty=cfg.length_penalty,
        early_stopping=early, pad_token_id=0, bos_token_id=1,
        eos_token_id=sorted(cfg.stop_token_ids) or None)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=generation)
    hypotheses = []
    for row in out[:, len(prompt):].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in cfg.stop_token_ids), len(row))
        hypotheses.append(tuple(row[:end]))
    return hypotheses


@pytest.mark.parametrize(("width", "n", "length_penalty", "early"), CASES)
def test_search_matches_transformers_generate_num_beams(width: int, n: int,
                                                        length_penalty: float,
                                                        early: bool | str):
    # Two prompts; EOS alone, then EOS plus tokens the search itself produces (so that
    # hypotheses end early and early stopping matters): the same hypotheses, in order.
    from e2e_stack import prompts, reference_model
    model = reference_model()
    for prompt in prompts(2, 9, seed=width):
        plain = config(width, n, 10, frozenset({EOS}), length_penalty, EARLY[early])
        first = _ours(model, prompt, plain)[0]
        extra = frozenset(t for t in first[2:4] if t != EOS)
        stops = frozenset({EOS}) | (extra if width <= 3 else frozenset(list(extra)[:1]))
        for cfg in (plain, config(width, n, 10, stops, length_penalty, EARLY[early])):
            assert _ours(model, prompt, cfg) == _theirs(model, prompt, cfg, early), cfg
    assert math.isfinite(length_penalty)
