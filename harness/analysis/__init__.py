"""Stage 4, statistics from rows: the reference run and first divergence (`metrics`), bounds per
setting, survival of agreement, near ties, splits, answers, the plan's power table, re-scoring and
noise floors, two folders compared, the CI gate. One `folder_analysis.Analysis` reads a folder once
for every command. May import: `core` to `run` (re-scoring loads an engine); never `report` or `cli`."""
