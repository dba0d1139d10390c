"""The experiment file: its schema, and loading it with errors that name file, line and field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, ValidationInfo, create_model, field_validator

from harness.core.errors import ConfigError
from harness.core.redaction import redact, redact_text
from harness.engines.registry import engine_names, options_model
from harness.experiment import yamlsrc
from harness.experiment.answers import ParseRule
from harness.experiment.axes import AXES, AXES_DECLARED, BY_NAME
from harness.experiment.prompts import (
    PromptItem,
    PromptSet,
    answer_rule_errors,
    load_prompt_set,
    merge_prompt_sets,
    prompt_set_from_inline,
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
    # YAML reads a bare on/off as true/false: an option spelled 'on' / 'off' gets its word back
    tries = [value] + (["on" if value else "off"] if isinstance(value, bool) else [])
    for attempt in tries:
        try:
            typed = adapter.validate_python(attempt)
            return typed, str(typed)
        except ValidationError as exc:
            error = exc
    raise ValueError(f"{name} {value!r}: {error.errors()[0]['msg']}") from None


def _as_list(value: Any) -> Any:
    return value if isinstance(value, list) else [value]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False, frozen=True)


class _MatrixRules(Strict):
    """Each axis is a list of values (a single value is read as a one-item list); each value is
    checked by its axis's declaration in harness.experiment.axes."""

    @field_validator("*", mode="before")
    @classmethod
    def _declared_before(cls, values: Any, info: ValidationInfo) -> list[Any]:
        return [BY_NAME[info.field_name].raw(v) for v in _as_list(values)]

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
GUARANTEES = ("bitwise", "same_tokens", "same_answers", "within_noise", "undecided", "diverges")


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
        "within_noise, undecided or diverges (strongest first)")
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
    another engine version. It needs the harness's own dependencies; this harness's code is put on
    its path, so both environments run the same harness."""

    python: str = Field(min_length=1, description="its interpreter, e.g. /opt/venvs/llama-0.3.2/bin/python")


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


def _validation_message(source: yamlsrc.Source, exc: ValidationError, prefix: tuple = ()) -> str:
    return yamlsrc.validation_message(source, exc, prefix, hints={"matrix": f"allowed axes: {', '.join(AXES)}"})


def _check_entries(
    source: yamlsrc.Source, section: str, entries: list[dict[str, Any]], loc_prefix: tuple | None = None,
    option_axes: dict[str, list[str]] | None = None,
    only_swept: bool = False,
) -> list[dict[str, Any]]:
    """Validate include/exclude/where entries: keys are axes (or swept engine options), values pass
    the axis' own checks. With `only_swept`, an engine option is a key only where it is swept (a rule's
    `where` on a column the rows do not have would select nothing, or everything)."""
    option_axes = option_axes or {}
    out = []
    for index, entry in enumerate(entries):
        loc = loc_prefix or (section, index)
        if not entry:
            if loc_prefix is not None:
                out.append({})
                continue
            raise ConfigError(f"{source.where(loc)}: {section}[{index}]: empty entry")
        unknown = [k for k in entry if k not in AXES and k not in option_axes
                   and (only_swept or option_axis(k) is None)]
        if unknown:
            raise ConfigError(
                f"{source.where(loc + (unknown[0],))}: {yamlsrc.format_loc(loc + (unknown[0],))}: "
                f"unknown axis; allowed: {', '.join(AXES + tuple(option_axes))}"
            )
        probe = {"model": ["x"], **{k: [v] for k, v in entry.items() if k in AXES}}
        try:
            checked = Matrix.model_validate(probe)
        except ValidationError as exc:
            raise ConfigError(_validation_message(source, exc, prefix=loc)) from None
        canonical = {k: getattr(checked, k)[0] for k in entry if k in AXES}
        for key in entry:
            if key not in AXES:
                try:
                    canonical[key] = option_value(key, entry[key])[1]
                except ValueError as exc:
                    raise ConfigError(f"{source.where(loc + (key,))}: {yamlsrc.format_loc(loc + (key,))}: {exc}") from None
        out.append({k: canonical[k] for k in entry})
    return out


def _split_option_axes(source: yamlsrc.Source) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """The experiment data without its 'ENGINE.OPTION' matrix keys, and those keys' raw values."""
    data = source.data
    matrix = data.get("matrix") if isinstance(data, dict) else None
    if not isinstance(matrix, dict):
        return data, {}
    swept = {k: _as_list(v) for k, v in matrix.items() if "." in str(k)}
    if not swept:
        return data, {}
    for key, values in swept.items():
        if option_axis(key) is None:
            raise ConfigError(f"{source.where(('matrix', key))}: matrix.{key}: not an engine option; write "
                              f"ENGINE.OPTION with ENGINE one of {', '.join(engine_names())}")
        if not values:
            raise ConfigError(f"{source.where(('matrix', key))}: matrix.{key}: empty list; give at least one value")
    rest = dict(data)
    rest["matrix"] = {k: v for k, v in matrix.items() if k not in swept}
    return rest, swept


def _check_option_axes(
    source: yamlsrc.Source, swept: dict[str, list[Any]], engine_options: dict[str, dict[str, Any]]
) -> dict[str, list[str]]:
    """Each swept option checked by its engine's schema (alone, then with the engine's other
    options); returns the canonical values. Errors name the file, line and value."""
    out: dict[str, list[str]] = {}
    for key, values in swept.items():
        engine, option = option_axis(key)  # type: ignore[misc]
        canonical = []
        for index, value in enumerate(values):
            loc = ("matrix", key, index)
            try:
                typed, text = option_value(key, value)
                options_model(engine).model_validate((engine_options.get(engine) or {}) | {option: typed})
            except ValueError as exc:  # ValidationError is a ValueError
                msg = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
                raise ConfigError(f"{source.where(loc)}: matrix.{key}[{index}]: {msg}") from None
            if text not in canonical:
                canonical.append(text)
        out[key] = canonical
    return out


def load_experiment(path: Path | str, model_files: bool = True) -> LoadedExperiment:
    """Load and fully validate an experiment file; raises ConfigError naming file:line and field.

    Model files named by path must exist here (`model_files=False`: not checked, for a file written
    for other machines; an experiment read back from a results folder's snapshot is not checked
    either: its files may be on another machine)."""
    path = Path(path)
    source = yamlsrc.load(path)
    loaded = _load(source, path.parent)
    if model_files:
        _check_model_files(source, loaded)
    return loaded


def _check_model_files(source: yamlsrc.Source, loaded: LoadedExperiment) -> None:
    """A .gguf path that is not a file is refused at its line, before any engine starts."""
    places = [(("matrix", "model", i), m) for i, m in enumerate(loaded.experiment.matrix.model)]
    places += [(("include", i, "model"), e["model"]) for i, e in enumerate(loaded.include) if "model" in e]
    for loc, model in places:
        if not str(model).lower().endswith(".gguf"):
            continue  # a registry name, a Hugging Face id or folder, a served name: the engine resolves it
        file = Path(model).expanduser()
        file = file if file.is_absolute() else loaded.base / file
        if not file.is_file():
            raise ConfigError(f"{source.where(loc)}: model '{model}': no such file ({file}; a relative path is read from the "
                              "experiment file's folder)")


def load_snapshot(snapshot: dict[str, Any], base: Path, where: Path) -> LoadedExperiment:
    """An experiment from its snapshot (see LoadedExperiment.snapshot); `where` names it in errors."""
    return _load(yamlsrc.Source(where, snapshot, {}), base)


#: the experiment's fields kept in its snapshot as written: the inputs of the runs, and its name
_NOT_REDACTED = ("name", "prompts", "fillers")


def _snapshot(data: dict[str, Any], prompt_set: PromptSet) -> dict[str, Any]:
    inline = dict(data)
    inline["prompts"] = [p.as_data() for p in prompt_set.prompts]
    inline["fillers"] = [f.text for f in prompt_set.fillers]
    inline.pop("parse", None)  # each prompt carries its own rule now
    # the snapshot is stored (manifest, experiment.yaml): one redaction pass over every field but the
    # prompts and fillers (the text the runs were given), so that no credential is kept anywhere a file
    # can hold one (options, swept options, include, exclude, rules' `where`, environments, cluster)
    inline = {key: value if key in _NOT_REDACTED else redact(value) for key, value in inline.items()}
    cluster = inline.get("cluster")
    if isinstance(cluster, dict) and isinstance(cluster.get("setup"), list):  # `export HF_TOKEN=...` lines
        inline["cluster"] = cluster | {"setup": [redact_text(str(line)) for line in cluster["setup"]]}
    return json.loads(json.dumps(inline, default=str))  # plain JSON types only


def _load(source: yamlsrc.Source, base: Path) -> LoadedExperiment:
    path = source.path
    if not isinstance(source.data, dict):
        raise ConfigError(f"{path}: expected a mapping with keys such as name, prompts, matrix")
    data, swept = _split_option_axes(source)
    try:
        experiment = Experiment.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_validation_message(source, exc)) from None

    engine_options: dict[str, dict[str, Any]] = {}
    used = set(experiment.matrix.engine) | {e.get("engine") for e in experiment.include} | set(experiment.engine_options)
    used |= {option_axis(k)[0] for k in swept}  # type: ignore[index]
    for engine in engine_names():
        if engine not in used:
            continue
        raw = experiment.engine_options.get(engine, {}) or {}
        try:
            engine_options[engine] = options_model(engine).model_validate(raw).model_dump()
        except ValidationError as exc:
            raise ConfigError(
                _validation_message(source, exc, prefix=("engine_options", engine))
            ) from None

    if isinstance(experiment.prompts, str) or all(isinstance(p, str) for p in experiment.prompts):
        files = [experiment.prompts] if isinstance(experiment.prompts, str) else list(experiment.prompts)
        prompt_set = merge_prompt_sets(
            [load_prompt_set(f, base, where=source.where(("prompts",))) for f in files], source.where(("prompts",))
        )
        if experiment.fillers is not None:
            prompt_set = prompt_set.with_fillers(experiment.fillers)
    else:
        prompt_set = prompt_set_from_inline(
            [p.prompt(experiment.parse) for p in experiment.prompts], experiment.fillers or []
        )
        ids = [p.id for p in experiment.prompts]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ConfigError(f"{source.where(('prompts',))}: prompts: duplicate id(s) {', '.join(dupes)}")
        for index in answer_rule_errors(list(experiment.prompts), experiment.parse):
            raise ConfigError(f"{source.where(('prompts', index))}: prompts[{index}]: an answer needs a parse rule; "
                              "give 'parse' here or at the top of the experiment")

    option_axes = _check_option_axes(source, swept, engine_options)
    include = _check_entries(source, "include", experiment.include, option_axes=option_axes)
    exclude = _check_entries(source, "exclude", experiment.exclude, option_axes=option_axes)
    rules = []
    for index, rule in enumerate(experiment.expect):
        where = _check_entries(source, "expect", [rule.where], loc_prefix=("expect", index, "where"),
                               option_axes=option_axes, only_swept=True)[0]
        rules.append(rule.model_copy(update={"where": where}))  # canonical values, as rows hold them
        if all(getattr(rule, k) is None for k in CONDITIONS):
            raise ConfigError(f"{source.where(('expect', index))}: expect[{index}]: no condition; give one of "
                              f"{', '.join(CONDITIONS)}")
    experiment = experiment.model_copy(update={"expect": rules})

    named = set(experiment.environments)
    if CURRENT_ENVIRONMENT in named:
        raise ConfigError(f"{source.where(('environments', CURRENT_ENVIRONMENT))}: environments: "
                          f"'{CURRENT_ENVIRONMENT}' is the harness's own interpreter; give the others other names")
    for index, value in [(None, v) for v in experiment.matrix.environment] + [
            (i, e["environment"]) for i, e in enumerate(include) if "environment" in e]:
        if value != CURRENT_ENVIRONMENT and value not in named:
            where = ("matrix", "environment") if index is None else ("include", index, "environment")
            raise ConfigError(f"{source.where(where)}: environment '{value}' is not named under environments:; "
                              f"allowed: {', '.join([CURRENT_ENVIRONMENT, *sorted(named)])}")
    if experiment.boots > experiment.repeats:
        raise ConfigError(f"{source.where(('boots',))}: boots: {experiment.boots} is more than repeats: "
                          f"{experiment.repeats}; every boot runs at least one repeat of each cell")
    sampled = experiment.matrix.temperature + [e["temperature"] for e in include if "temperature" in e]
    if experiment.seed_control and max(sampled) <= 0:
        raise ConfigError(f"{source.where(('seed_control',))}: seed_control: true checks seeds at temperature > 0, "
                          "and every temperature of this matrix is 0 (greedy decoding uses no seed)")
    largest = max(experiment.matrix.batch_size + [e.get("batch_size", 1) for e in include])
    if experiment.batch_fill == "copies":
        clash = [k for k in ("probe_logits", "probe_prefill", "unseeded_fillers") if getattr(experiment, k)]
        clash += ["filler_tokens > 0"] * any(v > 0 for v in experiment.matrix.filler_tokens +
                                              [e.get("filler_tokens", 0) for e in include])
        if clash:
            raise ConfigError(f"{source.where(('batch_fill',))}: batch_fill: copies has no single target or "
                              f"fillers; it cannot be combined with {', '.join(c if '>' in c else c + ': true' for c in clash)}")
    elif largest > 1 and not prompt_set.fillers:
        raise ConfigError(
            f"{source.where(('matrix', 'batch_size'))}: matrix.batch_size: batch size {largest} "
            "needs fillers (the other requests of a batch); add a 'fillers' list or use a prompt "
            "file that has one"
        )
    return LoadedExperiment(
        experiment=experiment,
        path=path.resolve(),
        prompt_set=prompt_set,
        engine_options=engine_options,
        include=include,
        exclude=exclude,
        snapshot=_snapshot(source.data, prompt_set),
        base=base.resolve(),
        option_axes=option_axes,
    )


class _ExpectFile(Strict):
    expect: list[Expectation] = Field(min_length=1)


def load_expectations(path: Path | str) -> list[Expectation]:
    """An `expect:` list from its own YAML file (for `harness check --expect`)."""
    source = yamlsrc.load(Path(path))
    try:
        rules = _ExpectFile.model_validate(source.data).expect
    except ValidationError as exc:
        raise ConfigError(_validation_message(source, exc)) from None
    return [rule.model_copy(update={"where": _check_entries(source, "expect", [rule.where],
                                                            loc_prefix=("expect", index, "where"))[0]})
            for index, rule in enumerate(rules)]
