"""Structured output: a request's constraint, checked and compiled with llguidance.

The gateway checks a request's constraint before admitting it (a bad one is INVALID_ARGUMENT
with llguidance's own words, and nothing is held); the executor compiles it again to mask
logits (executor_svc/grammar.py). Both sides turn the same record into the same llguidance
grammar here, and compile once per constraint: a Grammars cache keeps one matcher per
constraint (by its content) and hands out copies of it.

Why llguidance: bench/grammar_engines.py measures it beside xgrammar and outlines-core on the
embedded model's tokenizer. xgrammar's masks are cheaper (5 us against 87 a token, mean), but
it compiles a schema 10x slower (10 ms against 1; requests with their own schemas, tool calls
above all, pay it each time) and, on Linux x86-64, installs triton (1 GB, twice our CPU image's
torch). outlines-core refuses tokens of valid instances (its JSON regex fixes the whitespace)
and has no context-free grammars. llguidance has no dependencies, covers JSON Schema, regular
expressions and Lark grammars, and is what vLLM falls back to for schemas xgrammar refuses.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.errors import InvalidArgument, Unimplemented

if TYPE_CHECKING:  # llguidance is imported when the first constraint is compiled
    import llguidance

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# Bounds on what one request may make both services parse and compile.
MAX_SPEC_CHARS = 65_536
MAX_CHOICES = 1024
# JSON's whitespace between two tokens: at most one line break, then at most 20 spaces or
# tabs (pretty-printed JSON, ten levels deep). A model that keeps choosing whitespace would
# otherwise never end its output. A schema's own "x-guidance" options override it.
JSON_WHITESPACE = r"(?:\r?\n)?[\x20\x09]{0,20}"
CACHED_GRAMMARS = 256


class StructuredOutputError(InvalidArgument):
    """The constraint cannot be used: the message names the problem."""


class StructuredOutputUnavailable(Unimplemented):
    """This service cannot apply any constraint (its tokenizer cannot be loaded for it)."""


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """One request's constraint on its whole output: `kind` is one of KINDS.

    json_schema: `spec` is a JSON Schema as JSON text; json_object: any JSON object (`spec`
    empty); regex: the output matches `spec` (Rust regex syntax); choice: the output is one of
    `choices`; grammar: `spec` is a Lark grammar (llguidance's dialect) or a GBNF one.
    """

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        """What the constraint is, as a hash: compiled grammars are cached by it."""
        text = json.dumps([self.kind, self.spec, list(self.choices)])
        return hashlib.sha256(text.encode()).hexdigest()


def from_oneof(message: Any, field: str) -> StructuredOutput:
    """A proto StructuredOutput (either API's: the same oneof `constraint`) as the record
    (the caller checks HasField first); StructuredOutputError when no kind is set."""
    kind = message.WhichOneof("constraint")
    if kind is None:
        raise StructuredOutputError(f"{field}: set one of {', '.join(KINDS)}")
    if kind == "choice":
        return StructuredOutput("choice", choices=tuple(message.choice.values))
    if kind == "json_object":
        if not message.json_object:
            raise StructuredOutputError(f"{field}: json_object must be true when set")
        return StructuredOutput("json_object")
    return StructuredOutput(kind, spec=getattr(message, kind))


def to_oneof(constraint: StructuredOutput, message: Any) -> None:
    """Fill a proto StructuredOutput (either API's) from the record."""
    if constraint.kind == "choice":
        message.choice.values.extend(constraint.choices)
    elif constraint.kind == "json_object":
        message.json_object = True
    else:
        setattr(message, constraint.kind, constraint.spec)


def check_shape(constraint: StructuredOutput, field: str) -> None:
    """What can be checked without compiling: the kind, sizes, the parts each kind needs."""
    if constraint.kind not in KINDS:
        raise StructuredOutputError(
            f"{field}: unknown kind {constraint.kind!r}; use one of {', '.join(KINDS)}")
    size = len(constraint.spec) + sum(len(c) for c in constraint.choices)
    if size > MAX_SPEC_CHARS:
        raise StructuredOutputError(
            f"{field}: the constraint is {size} characters; at most {MAX_SPEC_CHARS} are "
            "accepted: make the schema or grammar smaller")
    if constraint.kind == "choice":
        if not constraint.choices:
            raise StructuredOutputError(f"{field}: choice needs at least one string")
        if len(constraint.choices) > MAX_CHOICES:
            raise StructuredOutputError(
                f"{field}: {len(constraint.choices)} choices; at most {MAX_CHOICES}")
    elif constraint.choices:
        raise StructuredOutputError(f"{field}: choices go with the choice kind only")
    if constraint.kind == "json_object" and constraint.spec:
        raise StructuredOutputError(f"{field}: json_object takes no schema")
    if constraint.kind in ("json_schema", "regex", "grammar") and not constraint.spec.strip():
        raise StructuredOutputError(f"{field}: {constraint.kind} is empty")


def grammar_text(constraint: StructuredOutput, field: str) -> str:
    """The constraint as an llguidance grammar (not yet checked against a tokenizer)."""
    import llguidance

    check_shape(constraint, field)
    matcher = llguidance.LLMatcher
    if constraint.kind == "json_schema":
        try:
            schema = json.loads(constraint.spec)
        except ValueError as exc:
            raise StructuredOutputError(f"{field}: the schema is not JSON: {exc}") from exc
        if not isinstance(schema, (dict, bool)):
            raise StructuredOutputError(f"{field}: a JSON Schema is an object or a boolean")
        return _compiled(lambda: matcher.grammar_from_json_schema(
            constraint.spec, defaults={"whitespace_pattern": JSON_WHITESPACE}), field)
    if constraint.kind == "json_object":
        return matcher.grammar_from_json_schema(
            {"type": "object"}, defaults={"whitespace_pattern": JSON_WHITESPACE})
    if constraint.kind == "regex":
        return _compiled(lambda: matcher.grammar_from_regex(constraint.spec), field)
    if constraint.kind == "choice":
        # Lark string literals take JSON's escapes: each choice matches only itself.
        alternatives = " | ".join(json.dumps(c) for c in constraint.choices)
        return f"start: {alternatives}\n"
    text = constraint.spec
    if "::=" in text:  # GBNF (llama.cpp's and vLLM's EBNF); Lark rules use ':'
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            text = gbnf_to_lark(text)
        except Exception as exc:  # noqa: BLE001 - a grammar error is the caller's input
            raise StructuredOutputError(f"{field}: the GBNF grammar is invalid: {exc}") from exc
    return _compiled(lambda: matcher.grammar_from_lark(text), field)


def _compiled(build: Any, field: str) -> str:
    try:
        return str(build())
    except Exception as exc:  # noqa: BLE001 - llguidance raises ValueError and others
        raise StructuredOutputError(f"{field}: {exc}") from exc


def load_tokenizer(
    model_dir: str | Path, vocab_size: int, eos_token_ids: tuple[int, ...]
) -> llguidance.LLTokenizer:
    """llguidance's tokenizer from the model directory's tokenizer.json (~1 s: cache it).

    `vocab_size` is the logits' width (it may exceed the tokenizer's); `eos_token_ids` are
    what a complete output may end with.
    """
    import llguidance

    path = Path(model_dir) / "tokenizer.json"
    try:
        return llguidance.LLTokenizer(path.read_text(), n_vocab=vocab_size,
                                      eos_token=list(eos_token_ids))
    except Exception as exc:  # noqa: BLE001 - missing, unreadable or not one llguidance reads
        raise StructuredOutputUnavailable(
            f"structured output cannot load {path} for this model ({exc}): this deployment "
            "applies no constraint") from exc


class Grammars:
    """Checked, compiled constraints for one tokenizer: one matcher per constraint, copied
    for each request. Thread-safe; keeps the CACHED_GRAMMARS most recently used."""

    def __init__(self, tokenizer: llguidance.LLTokenizer) -> None:
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    def matcher(self, constraint: StructuredOutput, field: str) -> llguidance.LLMatcher:
        """A new matcher at the start of the output; StructuredOutputError when the
        constraint does not compile for this tokenizer."""
        return self._template(constraint, field).deep_copy()

    def check(self, constraint: StructuredOutput, field: str) -> None:
        """Raises StructuredOutputError unless the constraint compiles (and caches it)."""
        self._template(constraint, field)

    def _template(self, constraint: StructuredOutput, field: str) -> llguidance.LLMatcher:
        """The constraint's compiled matcher, never advanced: requests get copies of it."""
        key = constraint.key
        with self._lock:
            template = self._compiled.get(key)
            if template is not None:
                self._compiled.move_to_end(key)
                return template
        template = self._compile(constraint, field)
        with self._lock:
            self._compiled[key] = template
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return template

    def _compile(self, constraint: StructuredOutput, field: str) -> llguidance.LLMatcher:
        import llguidance

        grammar = grammar_text(constraint, field)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self._tokenizer)
        if is_error:
            raise StructuredOutputError(f"{field}: {messages[0]}")
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise StructuredOutputError(f"{field}: {matcher.get_error()}")
        return matcher
