"""The shared context placed before every prompt of a cell: `context_tokens` tokens of a text.

Long prompts, prefix sharing and chunked prefill are swept through the `context_tokens` axis.
The text is the experiment's own, or a seeded run of common words; a cell takes as many of
its leading words as fit in the wanted number of tokens of the engine's own tokenizer, so
the same setting means the same length on every engine that can count tokens.

The `filler_tokens` axis uses the same words to make each batch-mate's prompt N tokens long
(`padded`), so that a batch's total tokens can be swept with the batch's requests unchanged.
"""

from __future__ import annotations

import hashlib
import random
from typing import Callable

#: common English words: most are one token in BPE vocabularies, so lengths grow smoothly
_WORDS = (
    "the of and to in is was for on that with as by at from his her they this which had not are but were "
    "be an have their one all there been has more when who will would into time some about other out "
    "them its only then also these two may first after years most over new such where people made city "
    "through between many part being under during before river school known called three world high "
    "century state while early water music family north south later great since small house found "
    "system second power place government among around along group number line name film book game "
    "light market field garden winter summer morning evening island village station bridge harbor"
).split()

SEPARATOR = "\n\n"


def generated_words(seed: int, count: int) -> list[str]:
    """`count` words drawn from a fixed list with a seeded generator (stable across Python versions)."""
    rng = random.Random(seed)
    return [rng.choice(_WORDS) for _ in range(count)]


def fit(words: list[str], tokens: int, count: Callable[[str], int]) -> tuple[str, int]:
    """The longest leading run of `words` whose text has at most `tokens` tokens, and its count.

    Token counts grow with words (one more word never makes fewer tokens in the tokenizers
    this serves), so a bisection over the word count finds it in a few dozen calls.
    """
    lo, hi = 0, len(words)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(" ".join(words[:mid])) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    text = " ".join(words[:lo])
    return text, count(text) if text else 0


def shared_context(text: str | None, seed: int, tokens: int, count: Callable[[str], int]) -> tuple[str, int]:
    """The context of a cell with `context_tokens` = `tokens`: (text, its token count)."""
    if tokens <= 0:
        return "", 0
    if text:
        source = text.split()
        while len(source) < 2 * tokens:  # a short text is repeated to reach long lengths
            source = source + text.split()
    else:
        source = generated_words(seed, 2 * tokens + 16)
    return fit(source, tokens, count)


def with_context(context: str, prompt: str) -> str:
    """The user message of a prompt in a cell with a shared context."""
    return f"{context}{SEPARATOR}{prompt}" if context else prompt


def padded(text: str, tokens: int, key: str, count: Callable[[str], int]) -> str:
    """A batch-mate's prompt made `tokens` long as the engine's tokenizer counts it (the `filler_tokens`
    axis): common words drawn with a generator seeded by `key` (one per filler, so that mates share no
    prefix a prefix cache could reuse), then its own text. A prompt already that long is left as it is."""
    if tokens <= 0 or count(text) >= tokens:
        return text
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    words = generated_words(seed, 2 * tokens + 16)
    pad, _ = fit(words, tokens, lambda lead: count(with_context(lead, text)))
    return with_context(pad, text)
