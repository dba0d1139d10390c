"""Stage 3, the results folder: where its files lie (`layout`), the Parquet row schema and its atomic
per-cell files (`store`), the rows a run becomes (`rows`), the folder's manifest, snapshot and current
or stale cells (`folder`), its lock, merging folders, cell states, and the provenance of every row.
Both the runner (which writes) and the analysis (which reads) stand on it. May import: `core`,
`models`, `engines`, `experiment`."""
