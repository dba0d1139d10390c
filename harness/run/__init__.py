"""Stage 2, running: the parent that decides what runs here (`runner`), the worker processes that
hold one engine load each (`launch`, `worker`), which stored runs can be kept (`reuse`), seed and
what-ran checks, logit probes during decoding, cluster submission and `doctor`. May import
everything below it: `core`, `models`, `engines`, `experiment`, `results`."""
