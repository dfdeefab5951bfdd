"""Constrained decoding: a request's output held to a JSON schema, a regex, a list of choices or a Lark grammar.

The grammar library is llguidance (Microsoft's, the engine behind vLLM's and SGLang's `guidance` backend): it
builds from a plain tokenizer (the Rust `tokenizers` JSON the engine already has), computes a token mask in
tens of microseconds without a precompiled per-grammar automaton (so a new schema costs no compile step worth
caching across tenants, and none leaks timing between them), takes explicit resource limits, and never raises
on a bad grammar or a bad token — it enters an error state, which this module turns into one request's failure.

Invariants:
- `StructuredOutputsParams` names exactly one constraint (vLLM's names: `json`, `regex`, `choice`, `grammar`,
  `json_object`), and checks it when constructed: a grammar llguidance refuses (including an unsupported JSON
  Schema keyword, which llguidance reports rather than ignores) is an `InvalidRequestError` naming the
  parameter, before the request reaches a step.
- Imports no torch (the API checks these parameters too); the matchers that enforce them are in
  `grammar_matcher.py`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import llguidance

from pagewise.engine.errors import InvalidRequestError

# Bounds on what one request's grammar may cost (llguidance's units; its defaults are 10× larger): a schema past
# them is refused when checked, and a step that would exceed them fails the request, never the engine.
LIMITS = dict(max_grammar_size=50_000, initial_lexer_fuel=200_000, step_lexer_fuel=100_000, step_max_items=20_000)
MAX_CONSTRAINT_CHARS = 64 * 1024  # a schema, regex or grammar's text; choices count their total length

_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


def parser_limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**LIMITS)


@dataclass(slots=True)
class StructuredOutputsParams:
    """What a request's output must match (vLLM's `StructuredOutputsParams`): one of `json` (a JSON Schema, as a
    dict or its text), `regex`, `choice` (a list of strings), `grammar` (Lark syntax) or `json_object` (any JSON
    object). `grammar_text` is the llguidance grammar it compiles to, checked on construction."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    grammar_text: str = field(init=False, default="")

    def __post_init__(self) -> None:
        given = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            _fail(f"structured_outputs must name exactly one of {', '.join(_CONSTRAINTS)}; got {given or 'none'}")
        self.grammar_text = _grammar(given[0], getattr(self, given[0]))
        check = llguidance.LLMatcher.validate_grammar_with_warnings
        failed, messages = check(self.grammar_text, limits=parser_limits())
        if failed:
            _fail(f"structured_outputs.{given[0]} cannot be enforced: {messages[0]}", given[0])


def _grammar(kind: str, value: Any) -> str:
    """The llguidance grammar for one constraint; a malformed value is an `InvalidRequestError`."""
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            _fail("structured_outputs.choice must be a non-empty list of non-empty strings", "choice")
        _check_size(sum(len(c) for c in value), "choice")
        alternatives = " | ".join(json.dumps(c) for c in value)  # Lark string literals are JSON's
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    if kind == "json":
        text = value if isinstance(value, str) else _dumps(value)
        _check_size(len(text), "json")
        try:
            schema = json.loads(text)
        except ValueError as error:
            _fail(f"structured_outputs.json is not valid JSON: {error}", "json")
        if not isinstance(schema, dict | bool):
            _fail("structured_outputs.json must be a JSON Schema (an object)", "json")
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
    if not isinstance(value, str) or not value:
        _fail(f"structured_outputs.{kind} must be a non-empty string", kind)
    _check_size(len(value), kind)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    return llguidance.LLMatcher.grammar_from_lark(value)


def _dumps(schema: Any) -> str:
    try:
        return json.dumps(schema)
    except (TypeError, ValueError) as error:
        _fail(f"structured_outputs.json is not JSON-serializable: {error}", "json")


def _check_size(size: int, name: str) -> None:
    if size > MAX_CONSTRAINT_CHARS:
        _fail(f"structured_outputs.{name} is {size:,} characters; at most {MAX_CONSTRAINT_CHARS:,} are allowed", name)


def _fail(message: str, name: str | None = None) -> None:
    raise InvalidRequestError(message, param="structured_outputs" if name is None else f"structured_outputs.{name}")


