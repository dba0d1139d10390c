"""YAML loading that remembers where each value came from, so errors can name a line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from harness.errors import ConfigError

if TYPE_CHECKING:
    from pydantic import ValidationError

Loc = tuple[Any, ...]


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


def _walk(node: yaml.Node, loc: Loc, out: dict[Loc, int]) -> None:
    out.setdefault(loc, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        seen: set[Any] = set()
        for key_node, value_node in node.value:
            key = key_node.value
            if key in seen:
                raise _Duplicate(key_node.start_mark.line + 1, key)
            seen.add(key)
            out[loc + (key,)] = key_node.start_mark.line + 1
            _walk(value_node, loc + (key,), out)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _walk(item, loc + (index,), out)


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
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        line = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{line}: invalid YAML: {exc.problem}") from None
    except yaml.YAMLError as exc:  # the reader's: a control character, a bad encoding mark
        line = text[: getattr(exc, "position", 0)].count("\n") + 1
        what = str(exc).splitlines()[0]
        raise ConfigError(f"{path}:{line}: invalid YAML: {what}") from None
    lines: dict[Loc, int] = {}
    if node is not None:
        try:
            _walk(node, (), lines)
        except _Duplicate as dup:
            raise ConfigError(f"{path}:{dup.line}: duplicate key '{dup.key}'") from None
    return Source(path=path, data=data, lines=lines)


def format_loc(loc: Loc) -> str:
    parts: list[str] = []
    for item in loc:
        parts.append(f"[{item}]" if isinstance(item, int) else ("." if parts else "") + str(item))
    return "".join(parts) or "(top level)"


def _clean_loc(loc: Loc) -> Loc:
    """Drop pydantic's union-branch markers such as 'str' or 'list[PromptItem]'."""
    markers = {"str", "int", "float", "function-after", "function-before"}
    return tuple(x for x in loc if not (isinstance(x, str) and ("[" in x or x in markers)))


def validation_message(
    source: Source, exc: ValidationError, prefix: Loc = (), hints: dict[str, str] | None = None
) -> str:
    """Every pydantic error as 'file:line: field: what is wrong', one per line.

    `hints` maps a top-level key to the text listing what is allowed under it.
    """
    hints = hints or {}
    out: list[str] = []
    for err in exc.errors():
        loc = prefix + _clean_loc(tuple(err["loc"]))
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key" + (f"; {hints[loc[0]]}" if loc and loc[0] in hints else "")
        elif err["type"] == "too_short":
            msg = "empty list; give at least one value"
        elif err["type"] == "missing":
            msg = "required key is missing"
        line = f"{source.where(loc)}: {format_loc(loc)}: {msg}"
        if line not in out:
            out.append(line)
    return "\n".join(out)
