"""`harness compare` on two result folders with known differences."""

from __future__ import annotations

import json

from harness.analysis.compare import around_split

from .conftest import row_for, run_harness, synthetic_folder


def _folder(root, gpu, outputs, extra_batch=False):
    """outputs: prompt_id -> token ids (repeat 0) for batch size 1; extra_batch adds a batch-2 cell."""
    folder, cells = synthetic_folder(root, sorted(outputs), {"gpu": [gpu], "batch_size": [1, 2] if extra_batch else [1]})
    by_batch = {c["batch_size"]: c for c in cells}
    folder.write_cell(by_batch[1].id, [row_for(by_batch[1], p, 0, t) for p, t in outputs.items()], "test")
    if extra_batch:
        folder.write_cell(by_batch[2].id, [row_for(by_batch[2], "p1", 0, [1, 2])], "test")
    return root


def test_compare_refuses_runs_of_other_prompt_or_batch_mate_texts(tmp_path):
    """A prompt id is only a name: runs are paired only where both folders gave the same text, with the
    same batch-mates."""
    def folder(root, gpu, text, filler):
        made, cells = synthetic_folder(root, ["p1"], {"gpu": [gpu], "batch_size": [2]}, texts={"p1": text},
                                       fillers=[filler])
        made.write_cell(cells[0].id, [row_for(cells[0], "p1", 0, [1, 2], filler_ids=["filler-00"])], "test")
        return root

    a = folder(tmp_path / "a", "A100", "Why is the sky blue?", "Name a colour.")
    same = _compare(a, folder(tmp_path / "b", "L40S", "Why is the sky blue?", "Name a colour."), "--format", "json")
    assert same.returncode == 0 and json.loads(same.stdout)[0]["same"] is True, same.stderr
    other_prompt = _compare(a, folder(tmp_path / "c", "L40S", "Why is the sea blue?", "Name a colour."))
    assert other_prompt.returncode == 1 and "prompt 'p1' has another text in B" in other_prompt.stderr
    other_mates = _compare(a, folder(tmp_path / "d", "L40S", "Why is the sky blue?", "Name a number."))
    assert other_mates.returncode == 1 and "1 paired run(s) had other batch-mates in B" in other_mates.stderr


def _compare(a, b, *extra):
    return run_harness("compare", str(a), str(b), *extra)


def test_compare_finds_known_differences_and_lists_unmatched_settings(tmp_path):
    a = _folder(tmp_path / "a100", "A100", {"p1": [1, 2, 3, 4], "p2": [5, 6, 7], "p3": [9, 9]}, extra_batch=True)
    b = _folder(tmp_path / "l40s", "L40S", {"p1": [1, 2, 3, 4], "p2": [5, 6, 8], "p3": [9, 9, 9]})
    out = _compare(a, b, "--format", "json")
    assert out.returncode == 0, out.stderr
    runs = {r["prompt_id"]: r for r in json.loads(out.stdout)}
    assert runs["p1"]["same"] is True and runs["p1"]["first_divergence"] is None
    assert runs["p2"]["same"] is False and runs["p2"]["first_divergence"] == 2
    assert runs["p3"]["first_divergence"] == 2  # a prefix diverges where it ends
    assert (runs["p2"]["gpu_a"], runs["p2"]["gpu_b"]) == ("A100", "L40S")
    table = _compare(a, b)
    assert "prompts changed" in table.stdout and "p2" in table.stdout
    assert "only in A" in table.stdout and "batch_size=2" in table.stdout  # not silently dropped


def test_compare_refuses_an_ignored_axis_that_varies_inside_a_folder(tmp_path):
    a = _folder(tmp_path / "a", "A100", {"p1": [1]}, extra_batch=True)
    b = _folder(tmp_path / "b", "L40S", {"p1": [1]})
    out = _compare(a, b, "--ignore", "gpu", "--ignore", "batch_size")
    assert out.returncode == 1 and "batch_size varies inside this folder" in out.stderr


def test_around_split_marks_the_first_differing_token():
    pieces = ["The", " sky", " is", " blue"]
    assert around_split(pieces, "The sky is blue", 2) == "The sky[ is] blue"
    assert around_split(pieces, "The sky is blue", 4) == "The sky is blue[(end)]"
    assert around_split(pieces, "The sky is blue", 3, before=4) == "…y is[ blue]"
    assert around_split(None, "The sky is blue", 2, before=3, after=4) == "The sky"  # no per-token text
