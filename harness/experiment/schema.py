"""The experiment file's schema: every key it may hold, its type and allowed values (pydantic
models); loading and checking a file against it is harness.experiment.config."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, ValidationInfo, create_model, field_validator

from harness.core.redaction import redact
from harness.engines.registry import engine_names, options_model
from harness.experiment import yamlsrc
from harness.experiment.answers import ParseRule
from harness.experiment.axes import AXES, AXES_DECLARED, BY_NAME
from harness.experiment.prompts import (
    PromptItem,
    PromptSet,
)


def option_axis(name: str) -> tuple[str, str] | None:
    """'ENGINE.OPTION' -> (engine, option) when it names a known engine; None for other names."""
    engine, dot, option = str(name).partition(".")
    return (engine, option) if dot and engine in engine_names() and option else None


def option_value(name: str, value: Any) -> tuple[Any, str]:
    """One value of an engine-option axis, checked by the engine's own option schema.

    Returns (the typed value the engine gets, its canonical text: the row column's value).
    Raises ValueError naming what is allowed.
    """
    engine, option = option_axis(name) or ("", "")
    fields = options_model(engine).model_fields if engine else {}
    if option not in fields:
        raise ValueError(f"'{name}' is not an option of engine '{engine}'; allowed: "
                         + ", ".join(f"{engine}.{k}" for k in fields))
    adapter = TypeAdapter(fields[option].rebuild_annotation())
    if value is None or value == "None":  # null, or its canonical text read back: None where the option takes it
        try:
            return adapter.validate_python(None), "None"
        except ValidationError:
            pass
    # YAML reads a bare on/off as true/false: an option spelled 'on' / 'off' gets its word back
    tries = [value] + (["on" if value else "off"] if isinstance(value, bool) else [])
    if isinstance(value, str) and value[:1] in "[{":  # a list or mapping option's canonical text, read back
        try:
            tries.append(ast.literal_eval(value))
        except (ValueError, SyntaxError):
            pass
    for attempt in tries:
        try:
            typed = adapter.validate_python(attempt)
            return typed, str(typed)
        except ValidationError as exc:
            error = exc
    # a list or mapping is not printed (an --api-key among extra_args); a scalar is, redacted by its option's name
    shown = repr(redact(value, option)) if isinstance(value, (str, int, float, bool)) else f"(a {type(value).__name__})"
    raise ValueError(f"{name} {shown}: {error.errors()[0]['msg']}") from None


def as_list(value: Any) -> Any:
    return value if isinstance(value, list) else [value]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False, frozen=True)


class _MatrixRules(Strict):
    """Each axis is a list of values (a single value is read as a one-item list); each value is
    checked by its axis's declaration in harness.experiment.axes."""

    @field_validator("*", mode="before")
    @classmethod
    def _declared_before(cls, values: Any, info: ValidationInfo) -> list[Any]:
        return [BY_NAME[info.field_name].raw(v) for v in as_list(values)]

    @field_validator("*")
    @classmethod
    def _declared(cls, values: list[Any], info: ValidationInfo) -> list[Any]:
        return [BY_NAME[info.field_name].typed(v) for v in values]


#: the matrix section of an experiment: one list-valued field per declared axis
Matrix = create_model(
    "Matrix", __base__=_MatrixRules,
    **{a.name: (list[a.type], Field(min_length=1) if a.required else Field(default=[a.default], min_length=1))
       for a in AXES_DECLARED},
)


class GpuResources(Strict):
    """Scheduler resources for the cells of one GPU type."""

    partition: str | None = None  # SLURM
    gres: str | None = None  # SLURM, e.g. gpu:a100:1
    constraint: str | None = None  # SLURM
    queue: str | None = None  # PBS
    select: str | None = None  # PBS, e.g. select=1:ncpus=8:ngpus=1:mem=32gb
    count: int = Field(1, ge=0, description="GPUs each task asks for when gres / select do not say (0: none)")


class Cluster(Strict):
    """How `harness submit` asks a scheduler for resources: per GPU type, plus common settings."""

    time: str = Field("04:00:00", pattern=r"^(\d+-)?\d{1,3}:\d{2}:\d{2}$")
    mem: str = Field("16G", pattern=r"^\d+[KMGT]?B?$")
    cpus: int = Field(4, ge=1)
    shards: int | None = Field(None, ge=1, description="array tasks per GPU type; default: one per engine load")
    account: str | None = None
    python: str | None = Field(None, description="interpreter on the nodes; default: the one running 'harness submit'")
    setup: list[str] = []
    gpus: dict[str, GpuResources] = {}


#: the conditions an `expect:` rule may give
CONDITIONS = ("unique_outputs", "match_rate_min", "divergence_rate_max", "divergence_bound_max", "divergence_rate_min",
              "logprobs_identical_min", "slowdown_max", "latency_ratio_max", "status", "accuracy_drop_max",
              "answer_agreement_min", "confident_flips_max", "guarantee")
#: guarantee classes, strongest first (harness.analysis.guarantees, which reads them from here)
GUARANTEES = ("bitwise", "same_tokens", "same_answers", "within_noise", "undecided", "diverges", "mode_ineffective")


class Expectation(Strict):
    """One CI rule, checked by `harness check` against the statistics of matching cells."""

    name: str | None = None
    where: dict[str, Any] = {}
    unique_outputs: int | None = Field(None, ge=1, description="at most this many distinct outputs per cell and prompt")
    match_rate_min: float | None = Field(None, ge=0, le=1)
    divergence_rate_max: float | None = Field(None, ge=0, le=1)
    divergence_bound_max: float | None = Field(
        None, gt=0, le=1, description="per setting, the 95% upper bound on the divergence rate is at most this "
        "(0.05: with 95% confidence fewer than 5% of runs depart); prompts are the unit unless bound: pooled")
    bound: Literal["prompts", "pooled"] = Field(
        "prompts", description="the bound divergence_bound_max reads: prompts as the independent unit (honest when "
        "runs of one prompt move together), or every run as independent (the pooled Clopper-Pearson bound)")
    divergence_rate_min: float | None = Field(
        None, ge=0, le=1, description="negative control: at least this share of the selection's compared runs "
        "diverge, and at least one, so the job proves it would catch a difference")
    logprobs_identical_min: float | None = Field(
        None, ge=0, le=1, description="at least this share of compared runs have tokens and every step's "
        "log-probability bitwise equal to the reference's")
    slowdown_max: float | None = Field(None, gt=0, description="batch-invariant throughput ratio, off / on")
    latency_ratio_max: float | None = Field(
        None, gt=0, description="batch-invariant serving latency ratio, on / off, at most this: latency_metric at "
        "latency_percentile over the paired runs (docs/rows.md#latency); a metric the engine does not record fails it")
    latency_metric: Literal["ttft", "itl", "tpot", "e2el"] = Field(
        "tpot", description="the latency latency_ratio_max reads: ttft, itl, tpot or e2el")
    latency_percentile: Literal[50, 90, 99] = Field(99, description="the percentile latency_ratio_max reads: 50, 90 or 99")
    status: str | None = Field(None, pattern="^(ok|failed|unsupported|skipped)$", description="every row has this status")
    accuracy_drop_max: float | None = Field(
        None, ge=0, le=1, description="accuracy may fall at most this much below the reference setting's (0.05 = 5 points)")
    answer_agreement_min: float | None = Field(
        None, ge=0, le=1, description="at least this share of runs give the reference run's answer")
    confident_flips_max: int | None = Field(
        None, ge=0, description="per setting, at most this many greedy runs depart where the reference's top-1 led "
        "top-2 by confident_margin or more (a likely bug, not rounding); a departure with no margin recorded fails it")
    confident_margin: float | None = Field(
        None, gt=0, description="the margin (nats) confident_flips_max counts from; default: the analysis's (2.0)")
    guarantee: Literal[GUARANTEES] | None = Field(  # type: ignore[valid-type]
        None, description="every selected setting keeps at least this class: bitwise, same_tokens, same_answers, "
        "within_noise, undecided, diverges or mode_ineffective (strongest first)")
    noise_margin: float | None = Field(
        None, gt=0, lt=1, description="for guarantee: within_noise, how much more often than the reference "
        "setting's own repeats a setting may depart (a share of runs; default 0.10), shown with 95% confidence")
    scope: Literal["all", "same_boot", "cross_boot"] = Field(
        "all", description="which compared runs the token rules (unique_outputs, match_rate_min, divergence_*) read: "
        "all, those compared with a reference run of their own engine load (same_boot), or of another load "
        "(cross_boot: with boots > 1, agreement across restarts)")
    allow_failed: bool = Field(False, description="judge the runs that did not fail instead of failing the rule")
    allow_missing: bool = Field(False, description="judge what ran, even where cells of the selection never ran "
                                                   "(missing) or were skipped (their GPU type was not there)")
    allow_unsupported: bool = Field(False, description="judge what ran, even where the engine refused cells of the "
                                                       "selection (unsupported: a setting it cannot honour)")


class EnvironmentSpec(Strict):
    """A Python environment a cell's worker may run under (the `environment` axis): another venv with
    another engine version, or the same interpreter with other environment variables (a kernel path:
    `ATEN_CPU_CAPABILITY: avx2`; `CUBLAS_WORKSPACE_CONFIG`, `VLLM_ATTENTION_BACKEND`, NCCL settings on
    GPU nodes). Another venv needs the harness's own dependencies; this harness's code is put on its
    path, so both environments run the same harness."""

    python: str | None = Field(None, min_length=1, description="its interpreter, e.g. /opt/venvs/llama-0.3.2/bin/python "
                               "(default: the harness's own)")
    env: dict[str, str] = Field({}, description="environment variables its workers start with, set before any "
                                "engine library loads (recorded in the rows' env column where their prefix is one "
                                "the rows keep; a credential's name never)")

    @field_validator("env", mode="before")
    @classmethod
    def _text_values(cls, value: Any) -> Any:
        """YAML reads `1` and `on` as numbers and booleans: a variable's value is its text."""
        if isinstance(value, dict):
            return {str(k): str(v).lower() if isinstance(v, bool) else str(v) for k, v in value.items()}
        return value


#: the environment that needs no entry: the interpreter running the harness
CURRENT_ENVIRONMENT = "current"


class SharedContext(Strict):
    """The text placed before every prompt (target and fillers) in cells with context_tokens > 0.

    Each cell takes as many leading words of it as fit in `context_tokens` tokens of the
    engine's tokenizer; without `text`, a seeded text of common words is generated.
    """

    text: str | None = Field(None, min_length=1, description="the shared context; default: generated from `seed`")
    seed: int = Field(0, ge=0, description="seed of the generated context")

    @field_validator("text")
    @classmethod
    def _has_words(cls, value: str | None) -> str | None:
        if value is not None and not value.split():  # a context is cut at word boundaries: it needs words
            raise ValueError("only whitespace; give text with words, or leave text out for a generated context")
        return value


class Experiment(Strict):
    """A validated experiment: what to run, how often, and with which engine options."""

    name: str = Field(min_length=1, pattern=yamlsrc.NAME_PATTERN)
    description: str = ""
    prompts: str | list[str] | list[PromptItem]
    parse: ParseRule | None = Field(default=None, description="inline prompts: the rule for those that give none")
    fillers: list[str] | None = None
    repeats: int = Field(default=1, ge=1, le=100_000)
    boots: int = Field(
        default=1, ge=1, le=1000, description="spread each cell's repeats over this many separate engine loads "
        "(a fresh worker process each, and a fresh server for a server engine): agreement across restarts is then "
        "measured apart from agreement within one load. Repeat r runs in boot r * boots // repeats.")
    max_tokens: int = Field(default=128, ge=1, le=32_768)
    filler_seed: int = Field(default=0, ge=0)
    probe_logits: bool = Field(
        default=False, description="compare full logit vectors with a lone run of each prompt, step by step"
    )
    probe_prefill: bool = Field(
        default=False, description="llamacpp: prefill prompt + output in one pass and compare its logits with decoding's"
    )
    rescore: bool = Field(
        default=False, description="after the run, prefill each ok run's prompt + output alone with its own engine, "
        "model and dtype and store each token's scoring log-probability (harness rescore; llamacpp and vllm)")
    unseeded_fillers: bool = Field(
        default=False, description="send the fillers of a batch without a seed (T > 0: does the target's seed hold?)"
    )
    seed_control: bool = Field(
        default=False, description="at temperature > 0, check before each cell that its seed takes effect (the "
        "same seed twice agrees, other seeds differ, alone and among batch-mates); a cell whose engine ignores "
        "or shares the seed is 'unsupported' with the reason instead of measured")
    batch_fill: Literal["fillers", "copies"] = Field(
        default="fillers", description="fillers: one measured target per batch among seeded fillers; copies: "
        "every member of a batch is the same prompt with the same seed, and each is a measured run "
        "(N concurrent requests of one prompt)")
    context: SharedContext = SharedContext()
    matrix: Matrix
    include: list[dict[str, Any]] = []
    exclude: list[dict[str, Any]] = []
    engine_options: dict[str, dict[str, Any]] = {}
    environments: dict[str, EnvironmentSpec] = Field(
        {}, description="named Python environments the environment axis chooses from ('current' is the "
        "harness's own and needs no entry)")
    cluster: Cluster = Cluster()
    expect: list[Expectation] = []

    def boot_of(self, repeat: int) -> int:
        """The boot (engine load, counted from 0) that runs `repeat`: contiguous blocks of repeats."""
        return repeat * self.boots // self.repeats

    @field_validator("engine_options")
    @classmethod
    def _options(cls, value: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for engine in value:
            if engine not in engine_names():
                raise ValueError(f"options for unknown engine '{engine}'; allowed: {', '.join(engine_names())}")
        return value


class LoadedExperiment(BaseModel):
    """An experiment plus what it needs from disk: its path and resolved prompt set."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)

    experiment: Experiment
    path: Path
    prompt_set: PromptSet
    engine_options: dict[str, dict[str, Any]]
    #: the include/exclude entries, validated and canonical
    include: list[dict[str, Any]]
    exclude: list[dict[str, Any]]
    #: the experiment as data with its prompt set written inline: it reloads to the same cells
    #: without the live files (a results folder keeps it in its manifest)
    snapshot: dict[str, Any]
    #: the folder relative model paths are resolved against (the experiment file's folder)
    base: Path
    #: engine options swept as axes ('llamacpp.flash_attn' -> canonical values), in file order
    option_axes: dict[str, list[str]] = {}

    @property
    def axes(self) -> tuple[str, ...]:
        """Every setting axis of this experiment: the fixed ones, then its swept engine options."""
        return AXES + tuple(self.option_axes)
