"""Stage 1, the experiment: a YAML file read with its line numbers, validated against the axes
(declared once in `axes`), its prompts, fillers and answer rules, expanded into cells with stable
ids and grouped by what needs one engine load (`matrix`), and the parts of it a command selects.
May import: `harness.core`, `harness.models`, `harness.engines` (their names, options and what
they do with each axis)."""
