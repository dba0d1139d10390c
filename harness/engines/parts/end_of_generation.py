"""One rule for the end of generation, shared by every engine.

A generation that stops because the model chose an end-of-generation token (the tokenizer's EOS,
a generation-config stop id such as Llama-3's <|eot_id|>, a chat end-of-turn such as <|im_end|>)
returns its ids *without* that token: the token is a decision step (its log-probability and
margin are kept with the others), not output. In-process llama.cpp never appends it; every other
engine removes it here. Without one rule, the same run through two engines would differ by one
token at the end, and a cross-engine comparison would show a divergence that is not there.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Collection

from harness.core.native_preload import LLAMA_CPP
from harness.engines.parts.child_probe import probe_in_child


def without_end(ids: list[int], pieces: list[str], end_ids: Collection[int] | None,
                stopped: bool) -> tuple[list[int], list[str]]:
    """`ids` (and their text `pieces`, when aligned) without a final end-of-generation token.

    `stopped`: the engine says the generation ended on a stop (not a length limit). `end_ids`: the
    model's end-of-generation set; None when it is not known, and then nothing is removed.
    """
    if not (stopped and ids and end_ids is not None and ids[-1] in end_ids):
        return ids, pieces
    return ids[:-1], pieces[:-1] if len(pieces) == len(ids) else pieces


_END_IDS = """
import json, sys, llama_cpp as ll
params = ll.llama_model_default_params()
params.vocab_only = True
model = ll.llama_model_load_from_file(sys.argv[1].encode(), params)
vocab = ll.llama_model_get_vocab(model) if model else None
print(json.dumps({"ids": [t for t in range(ll.llama_vocab_n_tokens(vocab)) if ll.llama_vocab_is_eog(vocab, t)]}
                 if model else {"error": "llama.cpp could not read the vocabulary"}))
"""


def gguf_end_ids(path: Path | str) -> frozenset[int] | None:
    """Every token a GGUF's vocabulary marks as ending generation (llama.cpp's `is_eog`: EOS, EOT,
    end-of-turn); None when llama-cpp-python is not installed to read it, or it cannot. Asked of
    llama.cpp in a child process, so that a worker that does not compute with llama.cpp never holds
    it (a GPU build of it can crash a process that holds pyarrow, harness.core.native_preload)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    answer = probe_in_child(_END_IDS, 120, (str(path),), preload=LLAMA_CPP)
    return frozenset(int(t) for t in answer["ids"]) if "ids" in answer else None
