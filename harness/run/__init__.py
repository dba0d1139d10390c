"""Stage 2, running: the parent that decides what runs here (`runner`), the worker processes that
hold one engine load each (`launch`, `worker`; `spare` and `ahead`: the first one, started before its
work order), which stored runs can be kept (`reuse`), seed and what-ran checks, logit probes during
decoding, cluster submission and `doctor`. May import everything below it: `core`, `models`,
`engines`, `experiment`, `results`."""
