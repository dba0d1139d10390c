"""Issue 65: one redaction for every string stored or printed. Credentials of every common shape
(user:password URLs with any characters in the password, credential query keys, bearer tokens with and
without a header name, provider key prefixes, JWTs, long and short flags) are planted, by hypothesis, in
the experiment's free fields and engine options; no stored file (manifest, experiment snapshot, report)
and no output of `plan`, `check --expect`, `status`, `summarize` and `report` holds one, and the text
around each is kept."""

from __future__ import annotations

import string

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.core.redaction import REDACTED, redact, redact_text
from harness.experiment.config import load_experiment
from harness.results.folder import ResultsFolder

from .conftest import PROMPTS, run_harness

_SECRET_CHARS = string.ascii_letters + string.digits
#: a password may hold what a URL parser takes for structure
_PASSWORD_CHARS = _SECRET_CHARS + "/?#!$%&*+,;=~-._"


def _secret(prefix: str = "", size: int = 24) -> st.SearchStrategy[str]:
    return st.text(_SECRET_CHARS, min_size=size, max_size=size + 8).map(lambda s: prefix + "Z9" + s)


#: (the text to plant, the secret that must not survive it)
SHAPES = st.one_of(
    st.tuples(st.text(_PASSWORD_CHARS, min_size=8, max_size=20).filter(lambda p: "@" not in p and "Z9" not in p)
              .map(lambda p: "Q7" + p + "Q7"), st.sampled_from(["http", "https", "postgres"]))
    .map(lambda t: (f"{t[1]}://user:{t[0]}@host.example:8000/v1 trailing words", t[0])),
    st.tuples(st.sampled_from(["token", "api_key", "access_token", "apikey", "password"]), _secret())
    .map(lambda t: (f"see https://host.example/path?x=1&{t[0]}={t[1]} and the rest", t[1])),
    _secret().map(lambda s: (f"Authorization: Bearer {s}", s)),
    _secret().map(lambda s: (f"token: Bearer {s} kept", s)),
    _secret().map(lambda s: (f"Bearer {s}", s)),
    st.sampled_from(["hf_", "sk-", "ghp_", "glpat-", "github_pat_"]).flatmap(
        lambda prefix: _secret(prefix).map(lambda s: (f"key {s} kept", s))),
    st.tuples(_secret("eyJ", 12), _secret("", 12), _secret("", 12))
    .map(lambda t: (f"jwt {t[0]}.{t[1]}.{t[2]} kept", t[1])),
    _secret().map(lambda s: (f"run --hf-token {s} --port 1", s)),
    _secret().map(lambda s: (f"run --api-key={s} --port 1", s)),
)

FLAG_SHAPES = st.one_of(
    _secret("hf_").map(lambda s: (["-hft", s], s)),
    _secret().map(lambda s: (["-hft", s], s)),
    _secret().map(lambda s: (["--api-key", s], s)),
    _secret().map(lambda s: ([f"--hf-token={s}"], s)),
    _secret("sk-").map(lambda s: (["--header", f"x: {s}"], s)),
)


@settings(max_examples=150, deadline=None)
@given(SHAPES)
def test_free_text_of_any_shape_keeps_no_credential_and_keeps_its_words(planted):
    text, secret = planted
    for shown in (redact_text(text), redact(text)):
        assert secret not in shown and REDACTED in shown, (text, shown)
    if "kept" in text or "trailing words" in text or "and the rest" in text:
        assert text.split()[-1] in redact_text(text)


@settings(max_examples=60, deadline=None)
@given(FLAG_SHAPES)
def test_option_values_and_flags_of_any_shape_are_redacted(planted):
    args, secret = planted
    assert secret not in str(redact(args)) and secret not in str(redact({"extra_args": args}))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(SHAPES, SHAPES, FLAG_SHAPES)
def test_no_file_or_output_of_an_experiment_holds_a_planted_credential(tmp_path_factory, free, rule, flags):
    root = tmp_path_factory.mktemp("planted")
    (root / "prompts.yaml").write_text(PROMPTS)
    experiment = {
        "name": "planted", "description": free[0], "prompts": "prompts.yaml",
        "matrix": {"model": ["smollm2-135m"], "engine": ["llamacpp", "llama-server"], "batch_size": [1]},
        "engine_options": {"llama-server": {"extra_args": flags[0]}},
        "expect": [{"name": rule[0], "status": "ok"}],
        "cluster": {"setup": [free[0]]},
    }
    (root / "exp.yaml").write_text(yaml.safe_dump(experiment))
    (root / "rules.yaml").write_text(yaml.safe_dump({"expect": [{"name": rule[0], "status": "ok"}]}))
    secrets = {free[1], rule[1], flags[1]}
    live = load_experiment(root / "exp.yaml", model_files=False)
    folder = ResultsFolder(root / "out")
    folder.adopt(live)
    out = str(root / "out")
    said = [run_harness("plan", str(root / "exp.yaml")), run_harness("check", out, "--expect", str(root / "rules.yaml")),
            run_harness("status", out), run_harness("summarize", out), run_harness("report", out)]
    texts = [p.read_text(errors="replace") for p in (root / "out").rglob("*") if p.is_file()]
    texts += [done.stdout + done.stderr for done in said]
    for secret in secrets:
        assert not any(secret in text for text in texts), secret
