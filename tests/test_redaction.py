"""Credentials are found by rule and written as <redacted> (harness.core.redaction)."""

from __future__ import annotations

from harness.core.redaction import REDACTED, redact, secret_name
from harness.experiment.config import load_experiment
from harness.experiment.matrix import expand
from harness.results import provenance
from harness.results.folder import ResultsFolder

from .conftest import PROMPTS


def test_credentials_are_found_by_name_flag_and_url():
    options = {
        "launch": ["vllm", "serve", "--api-key", "sk-1", "--hf-token=hf_2", "--port", "{port}", "--max-num-seqs", "8"],
        "base_url": "http://user:pw@host:8000/v1?api_key=q3&x=1",
        "api_key_env": "MY_KEY",  # the name of a variable, not a secret
        "extra": {"hf_token": "hf_4", "max_model_len": 4096},
        "top_k": True,
    }
    assert redact(options) == {
        "launch": ["vllm", "serve", "--api-key", REDACTED, f"--hf-token={REDACTED}", "--port", "{port}",
                   "--max-num-seqs", "8"],
        "base_url": f"http://{REDACTED}@host:8000/v1?api_key={REDACTED}&x=1",
        "api_key_env": "MY_KEY",
        "extra": {"hf_token": REDACTED, "max_model_len": 4096},
        "top_k": True,
    }
    assert [secret_name(n) for n in ("PASSWD", "auth_header", "x-api-key", "monkey", "keyframe", "top_k",
                                     "kv_cache_dtype", "n_gpu_layers")] == [True, True, True] + [False] * 5


def test_the_environment_record_leaves_out_every_credential_word(monkeypatch):
    for name in ("VLLM_API_KEY", "NCCL_PASSWD", "VLLM_AUTH", "CUDA_PASS"):
        monkeypatch.setenv(name, "s3cret")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    env = provenance.allowed_env()
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and "s3cret" not in env.values()


def test_a_key_is_no_part_of_a_cell_id_and_the_snapshot_expands_to_the_same_cells(write, tmp_path):
    write("prompts.yaml", PROMPTS)
    text = ("name: k\nprompts: prompts.yaml\nmatrix: {model: [smollm2-135m], engine: [openai]}\n"
            "engine_options: {openai: {base_url: 'http://u:KEY@127.0.0.1:1', served_model: m}}\n")
    one = load_experiment(write("a.yaml", text))
    two = load_experiment(write("b.yaml", text.replace("KEY", "OTHERKEY")))
    assert [c.id for c in expand(one)] == [c.id for c in expand(two)]
    folder = ResultsFolder(tmp_path / "out")
    folder.adopt(one)
    assert "KEY@" not in folder.manifest_path.read_text()
    assert [c.id for c in folder.current_cells()] == [c.id for c in expand(one)]


def test_url_credentials_and_a_bearer_key_are_one_or_the_other(tmp_path):
    """user:password@ in base_url is sent as HTTP Basic auth; with api_key_env too the options are
    refused at load, naming the field, and the password is not in the message."""
    import pytest

    from harness.core.errors import ConfigError
    from harness.engines.openai import _without_credentials
    from harness.experiment.config import load_experiment

    url, basic = _without_credentials("http://alice:s3cr%40t@127.0.0.1:9/openai/v1")
    assert url == "http://127.0.0.1:9/openai/v1" and basic == "YWxpY2U6czNjckB0"  # base64 of alice:s3cr@t
    assert _without_credentials("http://127.0.0.1:9/v1") == ("http://127.0.0.1:9/v1", "")
    (tmp_path / "exp.yaml").write_text(
        "name: both\nprompts: [{id: a, text: hi}]\nmatrix: {model: [m], engine: [openai]}\n"
        "engine_options:\n  openai: {base_url: 'http://alice:s3cret@127.0.0.1:9/v1', api_key_env: KEY}\n")
    with pytest.raises(ConfigError, match="give one of them") as err:
        load_experiment(tmp_path / "exp.yaml", model_files=False)
    assert "s3cret" not in str(err.value) and "exp.yaml:5" in str(err.value)


def test_no_field_of_the_experiment_keeps_a_secret_and_entries_still_select_what_they_name(write, tmp_path):
    import pandas as pd

    from harness.analysis.gate import _where

    write("prompts.yaml", PROMPTS)
    secret = "http://u:S3CRET1@127.0.0.1:1/v1"
    text = f"""
name: s
prompts: prompts.yaml
matrix:
  model: [smollm2-135m]
  engine: [openai]
  batch_size: [1, 4]
  openai.base_url: ['{secret}', 'http://127.0.0.1:2/v1']
engine_options: {{openai: {{served_model: m, base_url: 'http://u:S3CRET5@127.0.0.1:9/v1'}}}}
include: [{{openai.base_url: 'http://u:S3CRET2@127.0.0.1:3/v1', batch_size: 2}}]
exclude: [{{openai.base_url: '{secret}', batch_size: 4}}]
expect: [{{name: r, where: {{openai.base_url: '{secret}'}}, status: ok}}]
cluster: {{setup: ['export HF_TOKEN=hf_S3CRET3']}}
"""
    live = load_experiment(write("exp.yaml", text))
    cells = expand(live)
    assert len(cells) == 4  # 2 x 2, less the excluded one, plus the included one
    folder = ResultsFolder(tmp_path / "out")
    folder.adopt(live)
    for stored in (folder.manifest_path, tmp_path / "out" / "experiment.yaml"):
        assert "S3CRET" not in stored.read_text(), stored
    # rebuilt from the snapshot (no credential in it), the exclusion still removes the cell it named
    assert sorted(c.id for c in folder.current_cells()) == sorted(c.id for c in cells)
    # and a rule's `where` selects the rows it names: rows hold the redacted value only
    rows = pd.DataFrame({"openai.base_url": [c["openai.base_url"] for c in cells], "cell": [c.id for c in cells]})
    assert "S3CRET1" not in " ".join(rows["openai.base_url"])
    chosen = _where(rows, live.experiment.expect[0].where)
    assert len(chosen) == 1 and chosen["openai.base_url"].iloc[0] == f"http://{REDACTED}@127.0.0.1:1/v1"


def test_free_text_keeps_no_credential_and_model_input_holding_one_is_refused(write, tmp_path):
    """A description or a rule's name is free text: a token or URL password anywhere in it is stored and
    printed redacted. The name and the context cannot be (a folder's name, the model's input): refused."""
    import pytest

    from harness.core.errors import ConfigError

    write("prompts.yaml", PROMPTS)
    token, password = "hf_" + "Q" * 30, "PW5ecret"
    text = f"""
name: s
description: 'login with https://bob:{password}@hub.example/x then export HF_TOKEN={token}'
prompts: prompts.yaml
matrix: {{model: [smollm2-135m], engine: [llamacpp]}}
expect: [{{name: 'ok with sk-{"k" * 24}', status: ok}}]
"""
    live = load_experiment(write("exp.yaml", text))
    folder = ResultsFolder(tmp_path / "out")
    folder.adopt(live)
    for stored in (folder.manifest_path.read_text(), (tmp_path / "out" / "experiment.yaml").read_text(),
                   live.experiment.description, live.experiment.expect[0].name):
        assert token not in stored and password not in stored and "sk-kkkk" not in stored
    assert REDACTED in live.experiment.description and "hub.example/x" in live.experiment.description
    context = text.replace("prompts: prompts.yaml", f"prompts: prompts.yaml\ncontext: {{text: 'use {token} here'}}")
    with pytest.raises(ConfigError, match=r"exp2.yaml:\d+: context.text: holds what looks like a credential") as err:
        load_experiment(write("exp2.yaml", context))
    assert token not in str(err.value)
