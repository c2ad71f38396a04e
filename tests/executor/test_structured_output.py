"""Structured output in the runner: every output validates against its constraint (jsonschema
for schemas, re for regular expressions, over many schemas and seeds), greedy output equals a
reference loop (transformers' forward, the constraint's mask from llguidance's own byte-per-
token path), and a request recomputed, handed off, forked or chained goes on where it was.
Bad constraints and tokens the constraint forbids are INVALID_ARGUMENT, changing nothing."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import jsonschema
import pytest
from transformers import AutoTokenizer, PreTrainedModel

from common.errors import InvalidArgument, Unimplemented
from common.model_dirs import PRESETS_DIR
from common.structured_output import StructuredOutput
from executor_svc.runner import ModelRunner
from executor_svc.simulated.runner import build_simulated_runner
from executor_svc.simulated.settings import SimulatedSettings
from executor_svc.step import BlockTableDelta, SamplingParams, SequenceWork, StepRequest

from .oracle import (
    Driver,
    random_prompts,
    reference_constrained,
    reference_logits,
    reference_model,
)

COMPACT = {"whitespace_flexible": False, "whitespace_pattern": None}  # no whitespace at all
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                      "b": {"enum": ["x", "y"]}},
     "required": ["a", "b"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-z]{2,4}$"},
                                      "ok": {"type": "boolean"}, "n": {"type": "null"}},
     "required": ["id", "ok", "n"], "additionalProperties": False},
    {"anyOf": [{"type": "integer", "minimum": -5, "maximum": 5},
               {"type": "string", "maxLength": 3}]},
    {"type": "object", "properties": {
        "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["red", "green", "blue"]}},
        "score": {"type": "integer", "minimum": 0, "maximum": 9}},
     "required": ["tags"], "additionalProperties": False},
]
REGEXES = [r"[0-9]{3}-[a-z]{2}", r"(yes|no|maybe)!", r"[A-F]{1,4}\.[0-9]"]
MAX_NEW = 48


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    from executor_svc.runner import build_runner

    from .oracle import make_settings

    return build_runner(make_settings("tiny-llama", block_size=4, num_blocks=1024))


@pytest.fixture(scope="module")
def tokenizer(runner: ModelRunner) -> Any:
    return AutoTokenizer.from_pretrained(runner.grammars.model_dir)


def _schema(schema: dict[str, Any]) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps({**schema, "x-guidance": COMPACT}))


def _params(prompt: list[int], constraint: StructuredOutput, **fields: Any) -> SamplingParams:
    return SamplingParams(num_prompt_tokens=len(prompt), structured_output=constraint, **fields)


def _run(runner: ModelRunner, driver: Driver, requests: dict[str, tuple[list[int], SamplingParams]],
         chained: bool = False) -> dict[str, list[int]]:
    """Prefill each request in one shared step, then decode all until EOS or MAX_NEW (every
    other step through use_sampled_token rows when `chained`)."""
    eos = set(runner.info.eos_token_ids)
    seqs = tuple(driver.work(rid, prompt, True, params) for rid, (prompt, params)
                 in requests.items())
    outputs = {t.request_id: [t.token_id] for t in runner.execute(StepRequest(seqs=seqs)).tokens}
    step = 0
    while live := [rid for rid, out in outputs.items() if out[-1] not in eos
                   and len(out) < MAX_NEW]:
        stand_in = chained and step % 2 == 1
        seqs = tuple(dataclasses.replace(
            driver.work(rid, [0 if stand_in else outputs[rid][-1]], True),
            use_sampled_token=stand_in) for rid in live)
        for token in runner.execute(StepRequest(seqs=seqs)).tokens:
            outputs[token.request_id].append(token.token_id)
        step += 1
    runner.release(tuple(requests))
    return outputs


def _text(tokenizer: Any, runner: ModelRunner, out: list[int]) -> str:
    assert out[-1] in runner.info.eos_token_ids, f"the output never completed: {out}"
    return str(tokenizer.decode(out[:-1]))


def test_every_output_validates_over_schemas_and_seeds(runner: ModelRunner,
                                                       tokenizer: Any) -> None:
    driver = Driver.scattered(runner)
    prompts = random_prompts(runner.info.vocab_size, [5, 9, 13, 4], seed=11)
    requests = {}
    for index, schema in enumerate(SCHEMAS):
        for seed, prompt in enumerate(prompts):
            temperature = 0.0 if seed == 0 else 1.0
            requests[f"s{index}-{seed}"] = (prompt, _params(
                prompt, _schema(schema), temperature=temperature, seed=seed))
    outputs = _run(runner, driver, requests, chained=True)
    for rid, out in outputs.items():
        schema = SCHEMAS[int(rid[1:].split("-")[0])]
        jsonschema.validate(json.loads(_text(tokenizer, runner, out)), schema)


def test_regex_choice_and_grammar_outputs_match(runner: ModelRunner, tokenizer: Any) -> None:
    driver = Driver.scattered(runner, seed=3)
    prompt = random_prompts(runner.info.vocab_size, [6], seed=2)[0]
    choices = ("alpha", "beta gamma", 'quote " and \\ slash')
    lark = 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,2}/\n'
    requests = {}
    for seed in range(4):
        temperature = 0.0 if seed == 0 else 1.5
        for index, regex in enumerate(REGEXES):
            requests[f"re{index}-{seed}"] = (prompt, _params(
                prompt, StructuredOutput("regex", regex), temperature=temperature, seed=seed))
        requests[f"choice-{seed}"] = (prompt, _params(
            prompt, StructuredOutput("choice", choices=choices), temperature=temperature,
            seed=seed))
        requests[f"lark-{seed}"] = (prompt, _params(
            prompt, StructuredOutput("grammar", lark), temperature=temperature, seed=seed,
            logit_bias=((runner.info.eos_token_ids[0], 5.0),)))
        requests[f"gbnf-{seed}"] = (prompt, _params(
            prompt, StructuredOutput("grammar", 'root ::= "id-" [0-9] [0-9]?'),
            temperature=temperature, seed=seed))
    outputs = _run(runner, driver, requests)
    for rid, out in outputs.items():
        text = _text(tokenizer, runner, out)
        if rid.startswith("re"):
            assert re.fullmatch(REGEXES[int(rid[2])], text), (rid, text)
        elif rid.startswith("choice"):
            assert text in choices, text
        elif rid.startswith("lark"):
            assert re.fullmatch(r"\([0-9]{1,2}(,[0-9]{1,2})*\)", text), text
        else:
            assert re.fullmatch(r"id-[0-9][0-9]?", text), text


def test_json_object_outputs_open_an_object(runner: ModelRunner, tokenizer: Any) -> None:
    # Any object: a random model never closes one within a few steps, so the first steps'
    # text is checked, a prefix of some JSON object.
    driver = Driver.scattered(runner, seed=6)
    prompts = random_prompts(runner.info.vocab_size, [5, 8], seed=4)
    out = {}
    for i, prompt in enumerate(prompts):
        params = _params(prompt, StructuredOutput("json_object"), temperature=1.0, seed=i)
        out[i] = [t.token_id for t in runner.execute(StepRequest(seqs=(
            driver.work(f"o{i}", prompt, True, params),))).tokens]
        for _ in range(6):
            out[i] += [t.token_id for t in runner.execute(StepRequest(seqs=(
                driver.work(f"o{i}", [out[i][-1]], True),))).tokens]
        runner.release((f"o{i}",))
    for tokens in out.values():
        text = str(tokenizer.decode(tokens)).lstrip()
        assert text.startswith("{"), text


def _reference(model: PreTrainedModel, runner: ModelRunner, prompt: list[int],
               constraint: StructuredOutput) -> list[int]:
    return reference_constrained(
        lambda tokens: reference_logits(model, tokens)[-1], prompt, runner.grammars.model_dir,
        runner.info.vocab_size, runner.info.eos_token_ids, constraint, MAX_NEW)


def test_greedy_output_equals_reference_loop(runner: ModelRunner, tokenizer: Any) -> None:
    model = reference_model(runner)
    prompts = random_prompts(runner.info.vocab_size, [8, 3], seed=5)
    constraints = [_schema(SCHEMAS[0]), _schema(SCHEMAS[4]),
                   StructuredOutput("regex", REGEXES[0])]
    driver = Driver.scattered(runner, seed=9)
    requests = {f"g{i}-{j}": (prompt, _params(prompt, c)) for i, c in enumerate(constraints)
                for j, prompt in enumerate(prompts)}
    outputs = _run(runner, driver, requests, chained=True)
    for rid, (prompt, params) in requests.items():
        assert params.structured_output is not None
        assert outputs[rid] == _reference(model, runner, prompt,
                                          params.structured_output), rid


def test_recomputed_and_handed_off_requests_go_on_where_they_were(
    runner: ModelRunner, tokenizer: Any
) -> None:
    # Three ways to arrive with generated tokens already there, each against the same request
    # run straight through: a recompute (prompt + output re-prefilled in chunks of 3), a hand-
    # off (the blocks kept, history_token_ids), and an n > 1 fork child (greedy: its parent's).
    prompt = random_prompts(runner.info.vocab_size, [7], seed=8)[0]
    constraint = _schema(SCHEMAS[2])
    straight = _run(runner, Driver.scattered(runner), {"a": (prompt, _params(prompt, constraint))})
    full = straight["a"]
    cut = 6
    assert len(full) > cut + 2, "the output is long enough to cut"
    driver = Driver.scattered(runner, seed=4)
    tokens = prompt + full[:cut]
    params = _params(prompt, constraint)
    for start in range(0, len(tokens), 3):  # recompute: re-prefill prompt + generated tokens
        chunk = tokens[start:start + 3]
        last = start + 3 >= len(tokens)
        step = runner.execute(StepRequest(seqs=(driver.work(
            "r", chunk, last, params if start == 0 else None),)))
    rest = [t.token_id for t in step.tokens]
    handed = driver.work("r", [rest[-1]], True)
    runner.release(("r",))  # its blocks stay: a new request over them, as after a hand-off
    handed = dataclasses.replace(handed, sampling=params, history_token_ids=tuple(tokens),
                                 delta=BlockTableDelta(0, tuple(driver.tables["r"])))
    eos = set(runner.info.eos_token_ids)
    rest += [t.token_id for t in runner.execute(StepRequest(seqs=(handed,))).tokens]
    while rest[-1] not in eos and len(rest) + cut < MAX_NEW:
        rest += [t.token_id for t in runner.execute(
            StepRequest(seqs=(driver.work("r", [rest[-1]], True),))).tokens]
    assert full[:cut] + rest == full
    runner.release(("r",))


def test_min_tokens_yields_to_a_complete_output(runner: ModelRunner, tokenizer: Any) -> None:
    # min_tokens hides EOS, which a complete choice needs: the constraint wins.
    prompt = random_prompts(runner.info.vocab_size, [5], seed=1)[0]
    eos = runner.info.eos_token_ids
    params = _params(prompt, StructuredOutput("choice", choices=("no",)), min_tokens=20,
                     stop_token_ids=eos)
    out = _run(runner, Driver.scattered(runner), {"m": (prompt, params)})["m"]
    assert _text(tokenizer, runner, out) == "no"


def test_steps_sent_past_the_outputs_end_are_taken(runner: ModelRunner) -> None:
    # At depth 2 the caller sends the next step before it sees the EOS: the tokens after the
    # output's end are computed and never shown; the constraint ignores them.
    prompt = [5, 6, 7]
    driver = Driver.scattered(runner)
    params = _params(prompt, StructuredOutput("choice", choices=("no",)))
    out = [t.token_id for t in runner.execute(StepRequest(seqs=(
        driver.work("e", prompt, True, params),))).tokens]
    while out[-1] not in runner.info.eos_token_ids:
        out += [t.token_id for t in runner.execute(StepRequest(seqs=(
            driver.work("e", [out[-1]], True),))).tokens]
    for _ in range(2):
        chained = dataclasses.replace(driver.work("e", [0], True), use_sampled_token=True)
        assert runner.execute(StepRequest(seqs=(chained,))).tokens
    runner.release(("e",))


def _refused(runner: ModelRunner, work: SequenceWork) -> str:
    held = dict(runner.requests)
    with pytest.raises(InvalidArgument) as refused:
        runner.execute(StepRequest(seqs=(work,)))
    assert runner.requests == held, "a refused step changes nothing"
    return str(refused.value)


@pytest.mark.parametrize("constraint, message", [
    (StructuredOutput("json_schema", '{"type": "objekt"}'), "Invalid type"),
    (StructuredOutput("json_schema", "{not json"), "not JSON"),
    (StructuredOutput("regex", "(unclosed"), "unclosed group"),
    (StructuredOutput("grammar", "start: missing_rule"), "unknown name"),
    (StructuredOutput("grammar", 'root ::= "a'), "GBNF"),
    (StructuredOutput("choice"), "at least one"),
    (StructuredOutput("json_schema", "x" * 70_000), "at most 65536"),
    (StructuredOutput("json_object", "{}"), "takes no schema"),
    (StructuredOutput("xml"), "unknown kind"),
])
def test_bad_constraints_are_refused(runner: ModelRunner, constraint: StructuredOutput,
                                     message: str) -> None:
    driver = Driver.scattered(runner)
    assert message in _refused(runner, driver.work("bad", [5, 6], True, _params([5, 6],
                                                                               constraint)))


def test_tokens_the_constraint_forbids_are_refused(runner: ModelRunner,
                                                   tokenizer: Any) -> None:
    driver = Driver.scattered(runner)
    digits = StructuredOutput("regex", "[0-9]+")
    letter = tokenizer.encode("z", add_special_tokens=False)[-1]
    prompt = [5, 6, 7]
    no_start = dataclasses.replace(
        driver.work("h", prompt + [letter], True, _params(prompt, digits)))
    assert "not allowed" in _refused(runner, no_start)
    past = driver.work("p", list(range(9)), True, _params(prompt, digits))
    past = dataclasses.replace(past, token_ids=(9,), start_position=8)
    assert "history_token_ids" in _refused(runner, past)
    unsaid = driver.work("u", prompt, True, SamplingParams(structured_output=digits))
    assert "num_prompt_tokens" in _refused(runner, unsaid)
    # A held request: its next decode token must be allowed too.
    driver = Driver.scattered(runner, seed=5)
    first = runner.execute(StepRequest(seqs=(driver.work("d", prompt, True,
                                                         _params(prompt, digits)),)))
    assert first.tokens
    assert "at position 3" in _refused(runner, driver.work("d", [letter], True))
    # A row standing for the sampled token, then more tokens: those are checked too.
    driver.num_tokens["d"] -= 1
    ahead = dataclasses.replace(driver.work("d", [0, letter], True), use_sampled_token=True)
    assert "at position 4" in _refused(runner, ahead)
    runner.release(("d",))


def test_an_executor_without_structured_output_says_so() -> None:
    simulated = build_simulated_runner(SimulatedSettings(
        model=str(PRESETS_DIR / "tiny-llama"), time_scale=0.0, num_blocks=64))
    assert not simulated.info.structured_output
    work = SequenceWork("s", (5, 6), 0, delta=BlockTableDelta(0, (0,)), sample=True,
                        sampling=_params([5, 6], StructuredOutput("regex", "a")))
    with pytest.raises(Unimplemented, match="structured_output"):
        simulated.execute(StepRequest(seqs=(work,)))
