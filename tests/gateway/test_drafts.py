"""Prompt-lookup drafts (gateway/core/drafts.py): what is proposed, for whom, and the
--speculative-config that turns it on."""

from __future__ import annotations

import random

import pytest

from gateway.api.sampling import SamplingOptions
from gateway.core.drafts import NgramDrafts, may_draft, parse_speculative_config
from gateway.core.request_state import Request
from gateway.settings import load_settings as load_with_credentials


def load_settings(argv: list[str]):
    return load_with_credentials(["--insecure", *argv])


def naive(tokens: list[int], k: int, low: int, high: int, limit: int) -> tuple[int, ...]:
    """The definition, spelled out: the longest suffix first, its latest earlier occurrence."""
    for n in range(min(high, len(tokens) - 1), low - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tuple(tokens[start + n:start + n + min(k, limit)])
    return ()


def test_proposes_what_followed_the_latest_occurrence_of_the_longest_suffix():
    drafts = NgramDrafts(3, prompt_lookup_max=3, prompt_lookup_min=1)
    assert drafts.propose([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3], 8) == (7, 5, 2)  # 2, 3 latest
    assert drafts.propose([4, 2, 3, 8, 1, 2, 3, 7, 4, 2, 3], 8) == (8, 1, 2)  # 4, 2, 3 longest
    assert drafts.propose([1, 2, 3, 4], 8) == ()
    assert drafts.propose([5, 6, 5, 6], 1) == (5,)  # the limit
    assert drafts.propose([5, 6, 5, 6], 0) == ()


def test_a_byte_match_across_token_boundaries_is_no_match():
    # 256 and 1 pack as 00 01 00 00 | 01 00 00 00: the suffix [1] (01 00 00 00) also
    # occurs at byte offset 1 of 256, which is not a token.
    drafts = NgramDrafts(2, prompt_lookup_max=1, prompt_lookup_min=1)
    assert drafts.propose([256, 0, 0, 1], 4) == ()
    assert drafts.propose([1, 7, 256, 0, 1], 4) == (7, 256)


def test_agrees_with_the_definition_on_random_sequences():
    rng = random.Random(3)
    for _ in range(300):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 40))]
        k, low = rng.randint(1, 5), rng.randint(1, 3)
        high, limit = rng.randint(low, 5), rng.randint(0, 6)
        drafts = NgramDrafts(k, prompt_lookup_max=high, prompt_lookup_min=low)
        assert drafts.propose(tokens, limit) == naive(tokens, k, low, high, limit), tokens


@pytest.mark.parametrize(("options", "drafted"), [
    (SamplingOptions(max_tokens=8), True),
    (SamplingOptions(max_tokens=8, temperature=0.5), False),
    (SamplingOptions(max_tokens=8, logprobs=0), False),
    (SamplingOptions(max_tokens=8, repetition_penalty=1.1), False),
    (SamplingOptions(max_tokens=8, logit_bias=((5, 1.0),)), False),
    (SamplingOptions(max_tokens=8, min_tokens=2), False),
    (SamplingOptions(max_tokens=8, prompt_logprobs=1), False),
])
def test_only_requests_whose_tokens_are_their_argmax_are_drafted_for(options, drafted):
    request = Request("r", [1, 2], options, "")
    assert may_draft(request) is drafted
    # Prompt logprobs all in: still none (the executor holds the prompt, refusing drafts).
    request.record_prompt_logprobs(1, [-1.0], [1], [()])
    assert not request.needs_prompt_logprobs
    assert may_draft(request) is drafted


@pytest.mark.parametrize(("text", "message"), [
    ("{", "is not JSON"),
    ("[4]", "must be a JSON object"),
    ('{"num_speculative_tokens": 4, "draft_model": "x"}', r"unknown keys \['draft_model'\]"),
    ('{"method": "eagle", "num_speculative_tokens": 4}', "only \"ngram\""),
    ('{"method": "ngram"}', "needs num_speculative_tokens"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be an integer >= 1"),
    ('{"num_speculative_tokens": 17}', "at most 16"),
    ('{"num_speculative_tokens": true}', "must be an integer"),
    ('{"num_speculative_tokens": 2, "prompt_lookup_min": 5}', "prompt_lookup_min 5 is more"),
])
def test_a_bad_speculative_config_is_a_usage_error_naming_the_flag(
        text: str, message: str, capsys: pytest.CaptureFixture[str]):
    with pytest.raises(ValueError, match=message):
        parse_speculative_config(text)
    with pytest.raises(SystemExit) as info:
        load_settings(["--speculative-config", text])
    (error,) = capsys.readouterr().err.splitlines()  # one line, naming the flag
    assert info.value.code == 2 and "--speculative-config" in error


def test_the_speculative_config_reads_as_vllms():
    settings = load_settings(["--speculative-config", '{"method": "ngram", '
                              '"num_speculative_tokens": 5, "prompt_lookup_max": 3, '
                              '"prompt_lookup_min": 1}'])
    assert settings.speculative == NgramDrafts(5, 3, 1)
    assert load_settings([]).speculative is None
