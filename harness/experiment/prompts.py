"""Prompt sets, filler pools, and the seeded composition of a batch around one target prompt."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from harness.core.errors import ConfigError
from harness.experiment import yamlsrc
from harness.experiment.answers import KINDS, ParseRule


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    #: the expected answer, and how to read one from an output (harness.experiment.answers); both optional
    answer: str | None = None
    parse: ParseRule | None = None

    def as_data(self) -> dict[str, Any]:
        """The prompt as plain data (an experiment snapshot holds it)."""
        out: dict[str, Any] = {"id": self.id, "text": self.text}
        if self.answer is not None:
            out["answer"] = self.answer
        if self.parse is not None:
            out["parse"] = self.parse.model_dump(mode="json")
        return out


@dataclass(frozen=True)
class PromptSet:
    """Target prompts (measured) and fillers (the other users sharing a batch)."""

    prompts: tuple[Prompt, ...]
    fillers: tuple[Prompt, ...]
    source: str = "inline"

    def with_fillers(self, fillers: list[str]) -> PromptSet:
        return replace(self, fillers=_filler_prompts(fillers))

    def fingerprint(self) -> str:
        """Hash of every text: a changed prompt file gives new cell ids, never stale reuse."""
        digest = hashlib.sha256()
        for group in (self.prompts, self.fillers):
            for p in group:
                digest.update(f"{p.id}\0{p.text}\0".encode())
                if p.answer is not None or p.parse is not None:  # only then: older ids stay valid
                    digest.update(f"answer\0{p.answer}\0{p.parse.key() if p.parse else ''}\0".encode())
            digest.update(b"\1")
        return digest.hexdigest()[:16]

    def get(self, prompt_id: str) -> Prompt:
        for p in self.prompts:
            if p.id == prompt_id:
                return p
        raise KeyError(prompt_id)


def _filler_prompts(texts: list[str]) -> tuple[Prompt, ...]:
    return tuple(Prompt(f"filler-{i:02d}", t) for i, t in enumerate(texts))


def prompt_set_from_inline(prompts: list[Prompt], fillers: list[str]) -> PromptSet:
    return PromptSet(tuple(prompts), _filler_prompts(fillers))


class PromptItem(BaseModel):
    """One prompt as written in a file or inline: an id, its text, optionally its answer and parse rule."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    id: str = Field(min_length=1, pattern=yamlsrc.NAME_PATTERN)
    text: str = Field(min_length=1)
    answer: str | int | float | None = None
    parse: ParseRule | None = None

    def prompt(self, default_rule: ParseRule | None) -> Prompt:
        return Prompt(self.id, self.text, None if self.answer is None else str(self.answer),
                      self.parse or (default_rule if self.answer is not None else None))


def answer_rule_errors(items: list[PromptItem], default_rule: ParseRule | None) -> list[int]:
    """Indexes of prompts that give an answer but no rule to read it with."""
    return [i for i, p in enumerate(items) if p.answer is not None and p.parse is None and default_rule is None]


class _PromptFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompts: list[PromptItem] = Field(min_length=1)
    fillers: list[str] = []
    parse: ParseRule | None = Field(default=None, description="the parse rule of every prompt that gives none")


def load_prompt_set(ref: str, base: Path, where: str) -> PromptSet:
    """Load a prompt file; `ref` is relative to the experiment file's folder."""
    path = (base / ref).resolve()
    if path.is_dir():
        raise ConfigError(f"{where}: prompts: {path} is a folder; name a prompt file (YAML)")
    if not path.is_file():
        raise ConfigError(f"{where}: prompts: file not found: {path}")
    source = yamlsrc.load(path)
    if not isinstance(source.data, dict):
        raise ConfigError(f"{path}: expected a mapping with 'prompts' (a list of {{id, text}}) and 'fillers'")
    try:
        parsed = _PromptFile.model_validate(source.data)
    except ValidationError as exc:
        hints = {"prompts": "allowed: id, text, answer, parse", "fillers": "fillers are plain strings",
                 "parse": f"a rule: one of {', '.join(KINDS)}, or {{kind, options, pattern, field}}"}
        raise ConfigError(yamlsrc.validation_message(source, exc, hints=hints)) from None
    ids = [p.id for p in parsed.prompts]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ConfigError(f"{path}: prompts: duplicate id(s) {', '.join(dupes)}")
    for index in answer_rule_errors(parsed.prompts, parsed.parse):
        raise ConfigError(f"{source.where(('prompts', index))}: prompts[{index}]: an answer needs a parse rule; "
                          f"give 'parse' here or at the top of the file (one of {', '.join(KINDS)})")
    return PromptSet(
        tuple(p.prompt(parsed.parse) for p in parsed.prompts),
        _filler_prompts(parsed.fillers),
        source=str(path),
    )


def merge_prompt_sets(sets: list[PromptSet], where: str) -> PromptSet:
    """Several prompt files as one set (prompts and fillers in file order); ids must not repeat."""
    if len(sets) == 1:
        return sets[0]
    prompts = [p for s in sets for p in s.prompts]
    ids = [p.id for p in prompts]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ConfigError(f"{where}: prompts: the id(s) {', '.join(dupes)} appear in more than one file")
    fillers = [f.text for s in sets for f in s.fillers]
    return PromptSet(tuple(prompts), _filler_prompts(fillers), source=", ".join(s.source for s in sets))


@dataclass(frozen=True)
class Batch:
    """One batch: the target prompt at `target_position` among fillers."""

    prompts: tuple[Prompt, ...]
    target_position: int
    filler_ids: tuple[str, ...]


def compose_batch(
    prompt_set: PromptSet, target: Prompt, batch_size: int, repeat: int, filler_seed: int
) -> Batch:
    """Draw batch_size-1 fillers and the target's position with a seeded RNG.

    The draw depends on (filler_seed, prompt, repeat, batch_size) only, not on the engine,
    model or dtype, so cells that differ in those settings see the same batches.
    """
    if batch_size == 1:
        return Batch((target,), 0, ())
    key = f"{filler_seed}|{target.id}|{repeat}|{batch_size}".encode()
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))
    pool = prompt_set.fillers
    need = batch_size - 1
    picks = rng.choice(len(pool), size=need, replace=need > len(pool))
    fillers = [pool[int(i)] for i in picks]
    position = int(rng.integers(0, batch_size))
    members = fillers[:position] + [target] + fillers[position:]
    return Batch(tuple(members), position, tuple(f.id for f in fillers))


@dataclass(frozen=True)
class PlannedBatch:
    """One batch to run, and which of its members are measured runs: (position, repeat) pairs."""

    batch: Batch
    runs: tuple[tuple[int, int], ...]


def plan_batches(prompt_set: PromptSet, target: Prompt, batch_size: int, repeats: int, filler_seed: int,
                 fill: str = "fillers") -> list[PlannedBatch]:
    """The batches that give `repeats` runs of `target`, in run order.

    With fillers, repeat r is the target of batch r. With copies, batch k is `batch_size` copies
    of the target and its member p is repeat k*batch_size + p; the last batch keeps its full size
    (the batch shape is the setting) and measures only the repeats still wanted.
    """
    if fill == "fillers":
        batches = (compose_batch(prompt_set, target, batch_size, r, filler_seed) for r in range(repeats))
        return [PlannedBatch(b, ((b.target_position, r),)) for r, b in enumerate(batches)]
    copies = Batch((target,) * batch_size, 0, ())
    out = []
    for first in range(0, repeats, batch_size):
        runs = tuple((p, first + p) for p in range(batch_size) if first + p < repeats)
        out.append(PlannedBatch(copies, runs))
    return out
