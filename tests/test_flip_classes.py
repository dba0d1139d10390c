"""Flip classes and guarantee classes on folders written by hand: every run's tokens, log-probabilities
and reference margins are known here, so each class and count is worked out in the test from
those numbers, and the summary, the settings table, the gate and the report must agree with it."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import yaml

from harness.analysis import flips, guarantees
from harness.analysis.folder_analysis import Analysis
from harness.experiment.config import load_experiment
from harness.experiment.matrix import expand
from harness.results.folder_rows import open_results

from .conftest import row_for, run_harness, synthetic_folder

REF = [11, 12, 13, 14, 15, 16]
MARGINS = [3.0, 0.0, 0.05, 0.5, 2.5, 1.0]  # the reference's top-1 minus top-2 at each step
LOGPROBS = [-0.25] * len(REF)


def _departing(step: int) -> list[int]:
    return REF[:step] + [99] + REF[step + 1:]


def _folder(root, plan: dict[int, dict[tuple[str, int], list[int]]], logprob_shift: dict[int, float],
            answers: dict[tuple[int, str, int], str] | None = None):
    """Batch sizes 1, 2, 4, 8, prompts p1 and p2 (with a parse rule), 4 repeats. `plan[batch][(prompt,
    repeat)]` gives a run's tokens (default: the reference's); `answers` a run's parsed answer (default 'x')."""
    folder, _ = synthetic_folder(root, ["p1", "p2"], {"batch_size": [1, 2, 4, 8]}, repeats=4)
    spec_path = root.parent / f"{root.name}.yaml"
    spec = yaml.safe_load(spec_path.read_text())
    spec["prompts"] = [{"id": p, "text": f"question {p}", "answer": "x", "parse": "exact"} for p in ("p1", "p2")]
    spec_path.write_text(yaml.safe_dump(spec))
    loaded = load_experiment(spec_path)
    folder.adopt(loaded)
    for cell in expand(loaded):
        batch, rows = cell["batch_size"], []
        for prompt in ("p1", "p2"):
            for repeat in range(4):
                tokens = plan.get(batch, {}).get((prompt, repeat), REF)
                answer = (answers or {}).get((batch, prompt, repeat), "x")
                lp = [v + logprob_shift.get(batch, 0.0) for v in LOGPROBS]
                rows.append(row_for(cell, prompt, repeat, tokens, logprobs=lp, margins=MARGINS, schema_version=3,
                                    logprobs_hash=_lp_hash(lp), answer_parsed=answer, answer_expected="x",
                                    answer_correct=answer == "x", text=answer))
        folder.write_cell(cell.id, rows, "t")
    return folder


def _lp_hash(values: list[float]) -> str:
    from harness.results.rows import logprobs_hash

    return logprobs_hash(values)


def _expected_class(margin: float) -> str:
    """The classes as the module documents them, written out here."""
    if margin == 0:
        return "exact_tie"
    if margin < 0.1:
        return "near_tie"
    return "ordinary" if margin < 2.0 else "confident"


@pytest.fixture
def graded(tmp_path):
    plan = {2: {("p1", r): _departing(step) for r, step in enumerate((1, 2, 3, 4))},
            8: {("p1", 0): _departing(5)}}
    return _folder(tmp_path / "graded", plan, {4: 1e-3}, answers={(2, "p1", 0): "y"})


def test_departures_are_classed_by_the_reference_margin_and_settings_get_their_guarantee(graded):
    analysis = Analysis(open_results(graded.root))
    got = analysis.flips.sort_values(["batch_size", "repeat"])
    want = [(2, r, step, _expected_class(MARGINS[step])) for r, step in enumerate((1, 2, 3, 4))] + \
           [(8, 0, 5, _expected_class(MARGINS[5]))]
    assert [(int(b), int(r), int(s), c) for b, r, s, c in
            got[["batch_size", "repeat", "first_divergence", "flip_class"]].itertuples(index=False)] == want
    assert list(got["flip_margin"]) == pytest.approx([MARGINS[s] for _, _, s, _ in want])
    assert {c for *_, c in want} == {"exact_tie", "near_tie", "ordinary", "confident"}

    settings = analysis.by_setting.set_index("batch_size")
    assert settings.loc[2, ["flips_exact_tie", "flips_near_tie", "flips_ordinary", "flips_confident"]].tolist() == [1, 1, 1, 1]
    assert settings.loc[8, "flips_ordinary"] == 1 and settings.loc[4, "flips_confident"] == 0
    # batch 1's repeats are bitwise equal to its first run; batch 4 has the tokens with other
    # log-probabilities; batch 8 departs in tokens but gives every answer; batch 2 changes one
    # answer, and the reference's own repeats never depart: no noise floor to be within
    assert settings["guarantee"].to_dict() == {1: "bitwise", 2: "diverges", 4: "same_tokens", 8: "same_answers"}
    assert "8/8 runs" in settings.loc[4, "guarantee_evidence"] and "4/8 runs depart" in settings.loc[2, "guarantee_evidence"]

    from harness.report import html

    page = html.build(analysis)["guarantees"]
    assert [(b["setting"], b["token"], b["margin"]) for b in page["likely_bugs"]] == [("batch_size=2", 4, 2.5)]
    assert {s["setting"]: s["guarantee"] for s in page["settings"]}["batch_size=8"] == "same_answers"

    shown = run_harness("summarize", str(graded.root))
    assert shown.returncode == 0, shown.stderr
    line = next(t for t in shown.stdout.splitlines() if t.startswith("batch_size=2:"))
    assert line.startswith("batch_size=2: diverges;") and "1 confident (likely bug)" in line and "1 exact tie" in line
    assert any(t.startswith("batch_size=1: bitwise;") for t in shown.stdout.splitlines())
    table = json.loads(run_harness("summarize", str(graded.root), "--what", "flips", "--format", "json").stdout)
    assert sorted(r["flip_class"] for r in table) == sorted(c for *_, c in want)
    # a stricter confident margin moves the 2.5 departure to ordinary and keeps 3.0 out of reach
    strict = json.loads(run_harness("summarize", str(graded.root), "--what", "settings", "--format", "json",
                                    "--confident-margin", "3.0").stdout)
    assert {r["batch_size"]: r["flips_confident"] for r in strict}[2] == 0
    refused = run_harness("summarize", str(graded.root), "--near-tie", "3", "--confident-margin", "2")
    assert refused.returncode == 2 and "above --confident-margin 2" in refused.stderr


def test_gate_rules_on_confident_flips_and_guarantees(graded, tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"expect": [
        {"name": "no likely bugs at 2", "where": {"batch_size": 2}, "confident_flips_max": 0},
        {"name": "no likely bugs at 8", "where": {"batch_size": 8}, "confident_flips_max": 0},
        {"name": "looser margin", "where": {"batch_size": 2}, "confident_flips_max": 0, "confident_margin": 2.6,
         "allow_failed": True},
        {"name": "tokens at 4", "where": {"batch_size": 4}, "guarantee": "same_tokens"},
        {"name": "bitwise at 4", "where": {"batch_size": 4}, "guarantee": "bitwise"},
        {"name": "answers at 8", "where": {"batch_size": 8}, "guarantee": "same_answers"},
        {"name": "anything", "guarantee": "diverges"},
    ]}))
    junit = tmp_path / "j.xml"
    done = run_harness("check", str(graded.root), "--expect", str(rules), "--junit", str(junit))
    assert done.returncode == 1
    from xml.etree import ElementTree

    failed = {case.get("name"): case.find("failure") for case in ElementTree.parse(junit).getroot()}
    assert {name for name, f in failed.items() if f is not None} == {"no likely bugs at 2", "bitwise at 4"}
    assert "largest 2.50 at token 4" in failed["no likely bugs at 2"].get("message")
    assert "same_tokens (wants bitwise" in failed["bitwise at 4"].get("message")


def test_a_setting_is_within_noise_only_when_shown_within_the_margin(tmp_path):
    plan = {1: {("p1", 2): _departing(3)}, 2: {("p1", 1): _departing(3)}}
    folder = _folder(tmp_path / "noisy", plan, {}, answers={(1, "p1", 2): "y", (2, "p1", 1): "y"})
    settings = Analysis(open_results(folder.root)).by_setting.set_index("batch_size")
    # batch 2: 1 of 8 runs departs; batch 1's own repeats (6 besides the two reference runs): 1 of 6. Not
    # shown different, but not shown equivalent either: 8 and 6 runs cannot bound the excess to 10 points
    assert settings.loc[2, "guarantee"] == "undecided"
    assert (settings.loc[2, "floor_compared"], settings.loc[2, "floor_diverged"]) == (6, 1)
    assert "cannot decide" in settings.loc[2, "guarantee_evidence"]
    assert settings.loc[1, "guarantee"] == "diverges"  # the floor itself is never within its own noise
    assert guarantees.fisher_greater(5, 8, 0, 6) < guarantees.ALPHA  # 5 of 8 against 0 of 6 is beyond it
    # issue 43: 20 of 20 departing against a floor of 1 in 2 was "within noise" by failing to reject
    assert guarantees.noise_class(20, 20, 1, 2)[0] == "undecided"
    assert guarantees.noise_class(5, 8, 0, 6)[0] == "diverges"  # a floor that never departs has no noise
    beyond = guarantees.noise_class(8, 8, 1, 12)
    assert beyond[0] == "diverges" and "Fisher p" in beyond[1]
    # the rule's own margin: 1 of 8 against 1 of 6 over two prompts is bounded to 83 points (prompts as the
    # unit: two prompts cannot show less), within 0.9 and not within 0.1
    rules = tmp_path / "rules.yaml"
    for margin, code in ((0.9, 0), (None, 1)):
        rule = {"name": "noise", "where": {"batch_size": 2}, "guarantee": "within_noise"}
        rules.write_text(yaml.safe_dump({"expect": [rule | ({"noise_margin": margin} if margin else {})]}))
        done = run_harness("check", str(folder.root), "--expect", str(rules))
        assert done.returncode == code, done.stdout + done.stderr
        assert margin or "undecided (wants within_noise or stronger)" in " ".join(done.stdout.split())


def test_the_excess_bound_is_newcombes_computed_by_hand():
    """2 of 100 against 3 of 100: Wilson limits at z = 1.6449 by hand, then Newcombe's upper bound."""
    z = 1.6448536269514722

    def wilson(d, n):
        p = d / n
        centre = (p + z * z / (2 * n)) / (1 + z * z / n)
        half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
        return centre - half, centre + half

    (_, high1), (low0, _) = wilson(2, 100), wilson(3, 100)
    by_hand = 0.02 - 0.03 + math.sqrt((high1 - 0.02) ** 2 + (0.03 - low0) ** 2)
    assert guarantees.excess_bound(2, 100, 3, 100) == pytest.approx(by_hand, rel=1e-12)
    found, evidence, bound = guarantees.noise_class(2, 100, 3, 100)
    # one prompt: runs as the unit bound it, prompts as the unit cannot (issue 65), so it is not within noise
    assert guarantees.excess_upper([2], [100], [3], [100]) >= by_hand
    found, evidence, bound = guarantees.noise_class(2, 100, 3, 100)
    assert found == "undecided" and bound > 0.9 and "needs at least 35 prompts" in evidence
    # fifty prompts alike: Newcombe's bound with runs as the unit is the tighter one no more
    found, _, bound = guarantees.noise_class([2] * 50, [100] * 50, [3] * 50, [100] * 50)
    assert found == "within_noise" and bound >= guarantees.excess_bound(100, 5000, 150, 5000)


def test_sampled_and_unrecorded_departures_are_not_given_a_margin_class():
    got = flips.classify(np.array([5.0, np.nan, 0.0]), np.array([True, False, False]))
    assert list(got) == ["sampled", "unclassified", "exact_tie"]
    with pytest.raises(ValueError, match="at most the confident margin"):
        flips.classify(np.array([1.0]), np.array([False]), eps=3.0, confident=2.0)


def test_within_noise_takes_prompts_as_the_unit():
    """Issue 54: 150 of 1000 runs against a floor of 99 of 990 is within 10 points with every run an
    independent trial, yet most of those departures are one prompt's: a new prompt may well depart in
    most of its runs. By prompt (paired with the floor's repeats of the same prompt) it is not shown.
    Issue 65: one prompt gives no prompt-level evidence at all, and ten cannot show 10 points."""
    assert guarantees.noise_class(150, 1000, 99, 990)[0] != "within_noise"  # one prompt: no prompt-level evidence
    setting, floor = [75] + [8] * 6 + [9] * 3, [10] * 9 + [9]
    found, evidence, bound = guarantees.noise_class(setting, [100] * 10, floor, [99] * 10)
    assert found == "undecided" and bound > 0.15 and "prompts as the unit" in evidence
    spread = guarantees.noise_class([15] * 10, [100] * 10, floor, [99] * 10)  # the same totals, spread evenly
    assert spread[0] != "within_noise"
    assert guarantees.excess_upper([15] * 10, [100] * 10, floor, [99] * 10) > guarantees.excess_bound(150, 1000, 99, 990)
    # fifty prompts, one of them departing far more often: within the margin, never under the runs' bound
    many = guarantees.noise_class([75] + [8] * 49, [100] * 50, [10] * 50, [99] * 50)
    assert many[0] == "within_noise" and guarantees.excess_bound(467, 5000, 500, 4950) <= many[2] <= 0.10
    # a gate rule's own margin judges again from the figures the settings table keeps
    upper, p, se = guarantees.noise_test(setting, [100] * 10, floor, [99] * 10)
    record = {"guarantee": found, "guarantee_evidence": evidence, "diverged": 150, "compared": 1000, "prompts": 10,
              "floor_diverged": 99, "floor_compared": 990, "noise_excess_upper95": upper, "noise_excess_p": p,
              "noise_excess_se": se}
    assert guarantees.holds_with_margin(record, "within_noise", 0.40)[0]
    assert not guarantees.holds_with_margin(record, "within_noise", 0.10)[0]


def test_a_batch_invariant_setting_whose_batches_depart_is_mode_ineffective_not_a_divergence(tmp_path):
    """Issue 56: a mode on by flag whose batched runs are not bitwise the run alone did not take effect (as
    vLLM's flag outside its KV-offload namespace, vllm#58263). Rows written by hand stand in for a vLLM
    whose flag does nothing: batch 8 with the mode on moves one log-probability (tokens kept), batch 4
    with it on stays bitwise; with the mode off the same move is only same_tokens."""
    folder, cells = synthetic_folder(tmp_path / "bi", ["p1", "p2"],
                                     {"batch_size": [1, 4, 8], "batch_invariant": [False, True]}, repeats=2)
    for cell in cells:
        moved = cell["batch_size"] == 8
        rows = [row_for(cell, p, r, REF, logprobs=[v + (1e-6 if moved and p == "p1" and r == 0 else 0) for v in LOGPROBS],
                        margins=MARGINS, schema_version=3,
                        logprobs_hash=_lp_hash([v + (1e-6 if moved and p == "p1" and r == 0 else 0) for v in LOGPROBS]))
                for p in ("p1", "p2") for r in range(2)]
        folder.write_cell(cell.id, rows, "t")
    settings = Analysis(open_results(folder.root)).by_setting.set_index(["batch_invariant", "batch_size"])
    assert settings.loc[(True, 8), "guarantee"] == "mode_ineffective"
    assert "did not take effect" in settings.loc[(True, 8), "guarantee_evidence"]
    assert "1/4 in log-probabilities" in settings.loc[(True, 8), "guarantee_evidence"]
    assert settings.loc[(True, 4), "guarantee"] == "bitwise"
    assert settings.loc[(False, 8), "guarantee"] == "same_tokens"
    # a reference across the mode compares the mode with its absence: no mode verdict there
    across = Analysis(open_results(folder.root), reference={"batch_invariant": False}).by_setting
    assert "mode_ineffective" not in set(across["guarantee"])
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"expect": [
        {"name": "the mode keeps batches bitwise", "where": {"batch_invariant": True}, "guarantee": "bitwise"}]}))
    done = run_harness("check", str(folder.root), "--expect", str(rules))
    assert done.returncode == 1 and "mode_ineffective" in done.stdout, done.stdout


def test_the_mode_is_judged_across_the_batch_alone_never_across_gpus_or_seeds(tmp_path):
    """Issue 65: the mode promises batch invariance, not equality across GPU types or seeds. Two GPU types
    and two seeds, the mode on everywhere, every batch bitwise its own batch 1, while the H100 and seed 1
    give other log-probabilities than the A100 and seed 0: against `gpu=A100` or `seed=0` the settings get
    their ordinary class (same_tokens), and the evidence says the mode was not judged; against batch 1
    they are bitwise. A batch that moves on the H100 is still mode_ineffective against batch 1."""
    folder, cells = synthetic_folder(tmp_path / "gpus", ["p1", "p2"],
                                     {"batch_size": [1, 8], "gpu": ["A100", "H100"], "seed": [0, 1],
                                      "batch_invariant": [True]}, repeats=2)
    for cell in cells:
        shift = 1e-6 * ((cell["gpu"] == "H100") + 2 * (cell["seed"] == 1))
        values = [v + shift for v in LOGPROBS]
        rows = [row_for(cell, p, r, REF, logprobs=values, margins=MARGINS, schema_version=3, logprobs_hash=_lp_hash(values))
                for p in ("p1", "p2") for r in range(2)]
        folder.write_cell(cell.id, rows, "t")
    for rule in ({"gpu": "A100"}, {"seed": 0}, {"gpu": "A100", "batch_size": 1}):
        settings = Analysis(open_results(folder.root), reference=rule).by_setting
        assert "mode_ineffective" not in set(settings["guarantee"]), (rule, settings["guarantee"].tolist())
        moved = settings[settings["guarantee"] == "same_tokens"]
        assert len(moved) and all("mode not judged" in e for e in moved["guarantee_evidence"]), rule
    assert set(Analysis(open_results(folder.root)).by_setting["guarantee"]) == {"bitwise"}
    # the H100's batch of 8 moves at seed 0: against batch 1 that is the mode's failure
    h100 = next(c for c in cells if (c["gpu"], c["batch_size"], c["seed"]) == ("H100", 8, 0))
    moved, kept = [v + 2e-6 for v in LOGPROBS], [v + 1e-6 for v in LOGPROBS]
    folder.write_cell(h100.id, [row_for(h100, p, r, REF, logprobs=moved if p == "p1" else kept, margins=MARGINS,
                                        schema_version=3, logprobs_hash=_lp_hash(moved if p == "p1" else kept))
                                for p in ("p1", "p2") for r in range(2)], "t", replace_done=True)
    settings = Analysis(open_results(folder.root)).by_setting.set_index(["gpu", "seed", "batch_size"])
    assert settings.loc[("H100", 0, 8), "guarantee"] == "mode_ineffective"
    assert settings.loc[("A100", 0, 8), "guarantee"] == "bitwise"


def _run_stand_in(tmp_path, name: str, why: str, step: str, matrix: str, rule: str):
    """A stand-in engine (named so: it computes nothing) whose generate returns SequenceOutput([1, 2], ...) with
    `step` (lines defining `lp` and `margins`), run by `harness run` on two prompts (it must end 0); its environment."""
    import subprocess
    import sys
    import textwrap

    from .conftest import stand_in_engine

    env = stand_in_engine(
        tmp_path, name, why,
        on_generate=(step + "        out = SequenceOutput([1, 2], 'ab', 'length', lp, margins, ['a', 'b'])\n"
                     "        return BatchOutput(out, 2, None, None, 0.001, 0.001, 2)"))
    (tmp_path / "exp.yaml").write_text(textwrap.dedent(f"""
        name: {name}
        prompts: [{{id: a, text: hello}}, {{id: b, text: there}}]
        fillers: [other]
        repeats: 2
        max_tokens: 2
        matrix: {{model: [m], engine: [{name}], {matrix}}}
        expect:
          - {rule}
        """))
    ran = subprocess.run([sys.executable, "-m", "harness", "run", "exp.yaml", "--out", "out", "--progress", "plain"],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    return env


def test_a_run_through_an_engine_whose_flag_does_nothing_is_judged_mode_ineffective(tmp_path):
    """Issue 56, end to end: a stand-in engine (named as such: it computes nothing) that takes
    batch_invariant and ignores it, so a batch of more than one moves the last log-probability and keeps
    the tokens. `harness run` -> `summarize` calls the mode-on batched setting mode_ineffective (the mode-off
    one only same_tokens), and `check` fails the rule that wants the mode bitwise, saying why."""
    import subprocess
    import sys

    env = _run_stand_in(tmp_path, "flagless", "it accepts batch_invariant and ignores it, as a mode that never took effect",
                        "        lp, margins = [-0.5, -0.25 - 1e-6 * (len(prompts) - 1)], [5.0, 5.0]\n",
                        "batch_size: [1, 4], batch_invariant: [false, true]",
                        "{name: the mode keeps batches bitwise, where: {batch_invariant: true}, guarantee: bitwise}")
    done = subprocess.run([sys.executable, "-m", "harness", "summarize", "out", "--what", "settings", "-f", "json"],
                          capture_output=True, text=True, cwd=tmp_path, env=env)
    verdicts = {(r["batch_invariant"], r["batch_size"]): r["guarantee"] for r in json.loads(done.stdout)}
    assert verdicts[(True, 4)] == "mode_ineffective" and verdicts[(False, 4)] == "same_tokens"
    gate = subprocess.run([sys.executable, "-m", "harness", "check", "out"], capture_output=True, text=True,
                          cwd=tmp_path, env=env)
    assert gate.returncode == 1 and "mode_ineffective" in gate.stdout and "did not take effect" in gate.stdout


def test_a_passing_batch_invariant_rule_says_whether_its_negative_control_could_fail(tmp_path):
    """With the mode off, the same settings must be able to depart, or a passing check of the mode
    proves nothing: the verdict says which it is."""
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"expect": [
        {"name": "mode keeps tokens", "where": {"batch_invariant": True}, "match_rate_min": 1.0}]}))
    for name, off_departs, says in (("control", True, "negative control: with the mode off 1/3 runs departed"),
                                    ("no-control", False, "cannot tell the mode from its absence")):
        folder, cells = synthetic_folder(tmp_path / name, ["p1"],
                                         {"batch_size": [1, 8], "batch_invariant": [False, True]}, repeats=2)
        for cell in cells:
            departs = off_departs and cell["batch_size"] == 8 and not cell["batch_invariant"]
            folder.write_cell(cell.id, [row_for(cell, "p1", r, _departing(2) if departs and r == 0 else REF)
                                        for r in range(2)], "t")
        done = run_harness("check", str(folder.root), "--expect", str(rules))
        assert done.returncode == 0 and says in done.stdout, done.stdout


def test_log_probabilities_an_engine_did_not_give_are_never_called_bitwise(tmp_path):
    """Issue 65: an engine that hands out no log-probabilities (transformers' continuous batching when its
    config cannot ask for them) filled them with NaN; every run then hashed the same NaN bytes and
    `summarize` said "bitwise ... with bitwise-equal log-probabilities". A stand-in engine (named so: it
    computes nothing) gives the same tokens with NaN log-probabilities and margins: the rows hold null,
    the setting is same_tokens with "log-probabilities not recorded", and a `bitwise` rule fails."""
    import subprocess
    import sys

    from harness.results.rows import logprobs_hash, recorded

    assert recorded([math.nan, math.nan]) is None and logprobs_hash([math.nan, math.nan]) is None
    assert logprobs_hash([-0.5, math.nan]) is None and recorded([-0.5, math.nan]) == [-0.5, math.nan]
    env = _run_stand_in(tmp_path, "nolp", "it gives tokens and no log-probabilities, as an engine that cannot return them",
                        "        lp = margins = [float('nan'), float('nan')]\n", "batch_size: [1, 3]",
                        "{name: bitwise, where: {batch_size: 3}, guarantee: bitwise}")
    rows = pd.concat([pd.read_parquet(f) for f in (tmp_path / "out").rglob("*.parquet") if "cells" in str(f)])
    ok = rows[rows["status"] == "ok"]
    assert len(ok) and ok["logprobs_hash"].isna().all() and ok["logprobs"].isna().all() and ok["margins"].isna().all()
    done = subprocess.run([sys.executable, "-m", "harness", "summarize", "out"], capture_output=True, text=True,
                          cwd=tmp_path, env=env)
    said = " ".join(done.stdout.split())
    assert "bitwise-equal" not in said and "log-probabilities not recorded" in said, said + done.stderr
    gate = subprocess.run([sys.executable, "-m", "harness", "check", "out"], capture_output=True, text=True,
                          cwd=tmp_path, env=env)
    assert gate.returncode == 1 and "same_tokens" in gate.stdout, gate.stdout
