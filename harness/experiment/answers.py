"""Answers inside outputs: the parse rules a prompt may carry, and whether a parsed answer is right.

A rule reads one answer out of a generated text:
    number   the last number in the output (1,234.50 -> 1234.5)
    choice   a letter among the given options ("The answer is (B)" -> B)
    regex    the first group of a pattern (the whole match where it has no group)
    exact    the whole output, normalized (case, spaces, end punctuation)
    json     a field of the first JSON object in the output (dotted path: a.b.c)
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

KINDS = ("number", "choice", "regex", "exact", "json")


class ParseRule(BaseModel):
    """How to read the answer of a prompt's output (a plain string is read as `kind`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["number", "choice", "regex", "exact", "json"]
    options: tuple[str, ...] = Field(default=("A", "B", "C", "D"), description="choice: the allowed letters")
    pattern: str | None = Field(default=None, description="regex: the pattern; its first group is the answer")
    field: str | None = Field(default=None, description="json: the field (dotted path) holding the answer")

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return {"kind": value} if isinstance(value, str) else value

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"pattern does not compile: {exc}") from None
        return value

    @field_validator("options")
    @classmethod
    def _letters(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value or any(not re.fullmatch(r"[A-Za-z]", v) for v in value):
            raise ValueError("options are single letters, e.g. [A, B, C, D]")
        return tuple(v.upper() for v in value)

    @model_validator(mode="after")
    def _needs(self) -> ParseRule:
        if self.kind == "regex" and not self.pattern:
            raise ValueError("a regex rule needs 'pattern'")
        if self.kind == "json" and not self.field:
            raise ValueError("a json rule needs 'field'")
        return self

    def key(self) -> str:
        """A stable text of the rule, for fingerprints."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True)


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def _number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    if not found:
        return None
    return canonical_number(found[-1])


def canonical_number(text: str) -> str | None:
    """'1,234.50' -> '1234.5', '7.0' -> '7'; None when it is no number."""
    try:
        value = float(str(text).replace(",", "").strip())
    except ValueError:
        return None
    return str(int(value)) if value.is_integer() else repr(value)


def _choice(text: str, options: tuple[str, ...]) -> str | None:
    letters = "".join(options)
    stated = re.search(rf"answer\W{{0,12}}(?:is\W{{0,4}})?\(?([{letters}])\b", text, re.IGNORECASE)
    if stated:
        return stated.group(1).upper()
    alone = re.findall(rf"(?<![A-Za-z])\(?([{letters}])[\).:]?(?![A-Za-z])", text)
    return alone[0] if alone else None


def normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip().lower()).strip(" .!?\"'")


def _json_field(text: str, path: str) -> str | None:
    decoder = json.JSONDecoder()
    for start in (m.start() for m in re.finditer(r"\{", text)):
        try:
            value, _ = decoder.raw_decode(text[start:])
        except ValueError:
            continue
        for part in path.split("."):
            if not isinstance(value, dict) or part not in value:
                return None
            value = value[part]
        return value if isinstance(value, str) else json.dumps(value)
    return None


def parse(text: str, rule: ParseRule) -> str | None:
    """The answer `rule` reads from `text`; None when there is none."""
    if rule.kind == "number":
        return _number(text)
    if rule.kind == "choice":
        return _choice(text, rule.options)
    if rule.kind == "regex":
        match = re.search(rule.pattern or "", text)
        return None if match is None else (match.group(1) if match.groups() else match.group(0)).strip()
    if rule.kind == "exact":
        return normalize(text)
    return _json_field(text, rule.field or "")


def expected(answer: Any, rule: ParseRule) -> str:
    """The expected answer in the form `parse` gives, so the two compare as strings."""
    if rule.kind == "number":
        return canonical_number(str(answer)) or str(answer)
    if rule.kind == "choice":
        return str(answer).strip().upper()
    if rule.kind == "exact":
        return normalize(str(answer))
    return str(answer).strip()


def columns(text: str | None, answer: str | None, rule: ParseRule | None) -> dict[str, Any]:
    """The answer columns of a row: what was read, what was expected, whether they agree."""
    if rule is None:
        return {}
    parsed = parse(text or "", rule)
    want = None if answer is None else expected(answer, rule)
    return {
        "answer_parsed": parsed,
        "answer_expected": want,
        "answer_correct": None if want is None else parsed == want,
    }
