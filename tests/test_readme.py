"""README and docs promises that tests can check: the CI command, and the row contract."""

from __future__ import annotations

from pathlib import Path

from harness.results.schema import ROW_SCHEMA

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_readme_opens_with_two_commands_and_ci_runs_the_second():
    block = README.split("```bash\n", 1)[1].split("```", 1)[0].strip().splitlines()
    assert README.startswith("```bash\n") and len(block) == 2
    assert "harness run configs/quickstart.yaml" in block[0]
    ci = (ROOT / ".ci" / "run").read_text()
    assert block[1] in ci.splitlines()


def test_every_row_column_is_documented():
    contract = (ROOT / "docs" / "rows.md").read_text()
    missing = [name for name in ROW_SCHEMA.names if f"`{name}`" not in contract]
    assert not missing, f"columns not in docs/rows.md: {missing}"
