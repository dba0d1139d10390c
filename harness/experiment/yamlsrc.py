"""YAML loading that remembers where each value came from, so errors can name a line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from harness.core.errors import ConfigError

if TYPE_CHECKING:
    from pydantic import ValidationError

Loc = tuple[Any, ...]

#: what names and ids may be made of (they become file names and cell-id parts)
NAME_PATTERN = r"^[A-Za-z0-9_.-]+$"


@dataclass(frozen=True)
class Source:
    """A parsed YAML document plus a map from key paths to 1-based line numbers."""

    path: Path
    data: Any
    lines: dict[Loc, int]

    def line_of(self, loc: Loc) -> int | None:
        """Line of the deepest known prefix of `loc` (pydantic locations may go deeper)."""
        for end in range(len(loc), -1, -1):
            line = self.lines.get(tuple(loc[:end]))
            if line is not None:
                return line
        return None

    def where(self, loc: Loc) -> str:
        line = self.line_of(loc)
        return f"{self.path}:{line}" if line else str(self.path)


class _Duplicate(Exception):
    def __init__(self, line: int, key: Any) -> None:
        super().__init__(line, key)
        self.line, self.key = line, key


#: values a file may hold once its aliases are expanded: far more than any experiment, far less than
#: an alias bomb ("billion laughs"), which would otherwise take the loader hours
MOST_VALUES = 200_000


class _Refused(Exception):
    """A document this loader will not build: too big once expanded, self-referring, or with odd keys."""

    def __init__(self, line: int, why: str) -> None:
        super().__init__(line, why)
        self.line, self.why = line, why


def _walk(node: yaml.Node, loc: Loc, out: dict[Loc, int], inside: frozenset[int] = frozenset()) -> None:
    if len(out) > MOST_VALUES:
        raise _Refused(node.start_mark.line + 1, f"more than {MOST_VALUES} values once its aliases (*name) are "
                                                "expanded; write the values out, or use fewer aliases")
    if id(node) in inside:
        raise _Refused(node.start_mark.line + 1, "an alias (*name) that refers to the value it is in")
    out.setdefault(loc, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        seen: set[Any] = set()
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise _Refused(key_node.start_mark.line + 1, "a key that is a list or a mapping; keys are names")
            key = key_node.value
            if key in seen:
                raise _Duplicate(key_node.start_mark.line + 1, key)
            seen.add(key)
            out[loc + (key,)] = key_node.start_mark.line + 1
            _walk(value_node, loc + (key,), out, inside | {id(node)})
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _walk(item, loc + (index,), out, inside | {id(node)})


def load(path: Path) -> Source:
    """Read a YAML file; a missing file or a syntax error becomes a ConfigError."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: a folder, not a YAML file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x}); save the file as UTF-8") from None
    lines: dict[Loc, int] = {}
    try:
        loader = yaml.SafeLoader(text)  # parsed once: composed, walked for lines, then constructed
        node = loader.get_single_node()
        if node is not None:
            _walk(node, (), lines)  # before constructing: an alias bomb is refused, not expanded
        data = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        line = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{line}: invalid YAML: {exc.problem}") from None
    except yaml.YAMLError as exc:  # the reader's: a control character, a bad encoding mark
        line = text[: getattr(exc, "position", 0)].count("\n") + 1
        what = str(exc).splitlines()[0]
        raise ConfigError(f"{path}:{line}: invalid YAML: {what}") from None
    except _Duplicate as dup:
        raise ConfigError(f"{path}:{dup.line}: duplicate key '{dup.key}'") from None
    except _Refused as big:
        raise ConfigError(f"{path}:{big.line}: {big.why}") from None
    return Source(path=path, data=data, lines=lines)


def format_loc(loc: Loc) -> str:
    parts: list[str] = []
    for item in loc:
        parts.append(f"[{item}]" if isinstance(item, int) else ("." if parts else "") + str(item))
    return "".join(parts) or "(top level)"


def _branch(loc: Loc) -> tuple[int, str] | None:
    """Where in `loc` a union's branch marker sits, and the marker ('list[PromptItem]'), if any."""
    for index, part in enumerate(loc):
        if isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool")):
            return index, part
    return None


def _clean_loc(loc: Loc) -> Loc:
    """Drop pydantic's union-branch markers such as 'str' or 'list[PromptItem]'."""
    return tuple(x for x in loc if _branch((x,)) is None and x not in ("function-after", "function-before"))


def _meant(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The errors of the union branch the input was written for: pydantic reports one failure per
    branch ('should be a valid string' for a list of prompts), and the branch that got deepest into the
    value (then the one with the fewest faults) is the one meant. Where no branch got past the value's
    type, one error lists the types allowed."""
    by_union: dict[Loc, dict[str, list[dict[str, Any]]]] = {}
    out: list[dict[str, Any]] = []
    for err in errors:
        found = _branch(tuple(err["loc"]))
        if found is None:
            out.append(err)
            continue
        index, marker = found
        by_union.setdefault(tuple(err["loc"][:index]), {}).setdefault(marker, []).append(err)
    for where, branches in by_union.items():
        depth = {marker: max(len(e["loc"]) for e in errs) for marker, errs in branches.items()}
        deepest = max(depth.values())
        chosen = [m for m in branches if depth[m] == deepest]
        if len(chosen) == 1 or deepest > len(where) + 1:  # past the type: the branch with the fewest faults
            out.extend(branches[min(chosen, key=lambda m: len(branches[m]))])
            continue
        wanted = list(dict.fromkeys(str(e["msg"]).removeprefix("Input should be ") for m in chosen for e in branches[m]))
        out.append({"loc": where, "msg": "Input should be " + " or ".join(wanted), "type": "union"})
    return out


def validation_message(
    source: Source, exc: ValidationError, prefix: Loc = (), hints: dict[str, str] | None = None
) -> str:
    """Every pydantic error as 'file:line: field: what is wrong', one per line; of a union (a prompt
    file or a list of prompts), only the errors of the form the input was written in.

    `hints` maps a top-level key to the text listing what is allowed under it.
    """
    hints = hints or {}
    out: list[str] = []
    for err in _meant(exc.errors()):
        loc = prefix + _clean_loc(tuple(err["loc"]))
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key" + (f"; {hints[loc[0]]}" if loc and loc[0] in hints else "")
        elif err["type"] == "too_short":
            msg = "empty list; give at least one value"
        elif err["type"] == "missing":
            msg = "required key is missing"
        elif err["type"] == "string_pattern_mismatch" and err.get("ctx", {}).get("pattern") == NAME_PATTERN:
            msg = f"{err.get('input')!r}: use only letters, digits and _ . - (it names files and ids)"
        line = f"{source.where(loc)}: {format_loc(loc)}: {msg}"
        if line not in out:
            out.append(line)
    return "\n".join(out)
