"""Loading an experiment file with errors that name file, line and field; its schema is
harness.experiment.schema."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError

from harness.core.errors import ConfigError
from harness.core.redaction import has_credential, redact, redact_text
from harness.engines.registry import engine_names, options_model
from harness.experiment import yamlsrc
from harness.experiment.axes import AXES
from harness.experiment.prompts import (
    PromptSet,
    answer_rule_errors,
    load_prompt_set,
    merge_prompt_sets,
    prompt_set_from_inline,
)
from harness.experiment.schema import (
    CONDITIONS,
    CURRENT_ENVIRONMENT,
    Expectation,
    Experiment,
    LoadedExperiment,
    Matrix,
    Strict,
    as_list,
    option_axis,
    option_value,
)


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
    swept = {k: as_list(v) for k, v in matrix.items() if "." in str(k)}
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


def _include_options(source: yamlsrc.Source, include: list[dict[str, Any]], swept: dict[str, list[str]],
                     engine_options: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """Engine options that an include entry sets and the matrix does not sweep, as axes of one value
    (the option as engine_options or the engine's default has it), so that the included cell is told
    apart from the others by a column, not merged with one that lacks the option."""
    out: dict[str, list[str]] = {}
    for index, entry in enumerate(include):
        for key, value in entry.items():
            if key in AXES or key in swept:
                continue
            engine, option = option_axis(key)  # type: ignore[misc]
            given = engine_options.get(engine) or {}
            try:
                options_model(engine).model_validate(given | {option: option_value(key, value)[0]})
            except ValueError as exc:  # ValidationError is a ValueError
                msg = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
                raise ConfigError(f"{source.where(('include', index, key))}: include[{index}].{key}: {msg}") from None
            if key not in out:
                field = options_model(engine).model_fields[option]
                out[key] = [option_value(key, given.get(option, field.get_default(call_default_factory=True)))[1]]
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
    if isinstance(inline.get("description"), str):  # free text: a token or URL password anywhere in it
        inline["description"] = redact_text(inline["description"])
    if isinstance(inline.get("expect"), list):
        inline["expect"] = [_named_safely(rule) if isinstance(rule, dict) else rule for rule in inline["expect"]]
    cluster = inline.get("cluster")
    if isinstance(cluster, dict) and isinstance(cluster.get("setup"), list):  # `export HF_TOKEN=...` lines
        inline["cluster"] = cluster | {"setup": [redact_text(str(line)) for line in cluster["setup"]]}
    return json.loads(json.dumps(inline, default=str))  # plain JSON types only


def _named_safely(rule: dict[str, Any]) -> dict[str, Any]:
    """An `expect:` rule whose free-text name is stored and printed redacted."""
    return rule | {"name": redact_text(rule["name"])} if isinstance(rule.get("name"), str) else rule


def _refuse_credentials(source: yamlsrc.Source, experiment: Experiment) -> None:
    """The experiment's name names its folder and the context is given to the model, so neither can be
    stored redacted: one that holds a credential is refused (prompts are the user's input, as written)."""
    for loc, text in ((("name",), experiment.name), (("context", "text"), experiment.context.text)):
        if has_credential(text):
            raise ConfigError(f"{source.where(loc)}: {yamlsrc.format_loc(loc)}: holds what looks like a credential "
                              f"('{redact_text(text)[:120]}'); it would be stored in manifests and results as "
                              "written: remove it")


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
    option_axes |= _include_options(source, experiment.include, option_axes, engine_options)  # values as written
    exclude = _check_entries(source, "exclude", experiment.exclude, option_axes=option_axes)
    rules = []
    for index, rule in enumerate(experiment.expect):
        where = _check_entries(source, "expect", [rule.where], loc_prefix=("expect", index, "where"),
                               option_axes=option_axes, only_swept=True)[0]
        # canonical values, as rows hold them; the name redacted, as it is printed and stored
        rules.append(rule.model_copy(update={"where": where, "name": redact_text(rule.name)}))
        if all(getattr(rule, k) is None for k in CONDITIONS):
            raise ConfigError(f"{source.where(('expect', index))}: expect[{index}]: no condition; give one of "
                              f"{', '.join(CONDITIONS)}")
    _refuse_credentials(source, experiment)
    experiment = experiment.model_copy(update={"expect": rules, "description": redact_text(experiment.description)})

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
                                                            loc_prefix=("expect", index, "where"))[0],
                                    "name": redact_text(rule.name)})
            for index, rule in enumerate(rules)]
