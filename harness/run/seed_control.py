"""Seed control: at temperature > 0, does the cell's seed take effect before its runs are measured?

Sampled runs can only be compared if the seed fixes the sampling. Engines and servers differ:
some ignore `seed` (SGLang's OpenAI endpoints, sglang #15481), some broadcast one seed over a
whole batch (vLLM #50440: every prompt of a batch got the same noise). Either way differences
would be measured as non-determinism when they are the seed's doing. The control runs the cell's
first prompts a few times before the cell: the same seed twice must agree, different seeds must not all agree,
alone and among batch-mates. A seed that fails is reported as such (the cell is 'unsupported'
with the reason), never measured.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from harness.engines.base import BatchOutput, Sampling

#: generate(prompts, target, sampling, members) -> the batch's output
Generate = Callable[[list[str], int, Sampling, bool], BatchOutput]

#: different seeds tried on a prompt, and prompts tried, before "the seed has no effect" is concluded
SEEDS_TRIED = 6
PROMPTS_TRIED = 3
#: copies of one prompt in the batch-mates control (at most the cell's batch size)
MATES = 4

HONOURED = "honoured"
#: verdicts that stop the cell: the seed does not fix the sampling, so runs would measure the seed
FAILING = ("ignored", "shared")


@dataclass(frozen=True)
class SeedCheck:
    """The control's verdict: `state` is honoured, ignored, shared or unrepeatable; `text` says why."""

    state: str
    text: str

    @property
    def fails(self) -> bool:
        return self.state in FAILING

    @property
    def column(self) -> str:
        """The row's `seed_check` value."""
        return self.state if self.state == HONOURED else f"{self.state}: {self.text}"


def _ids(out: BatchOutput) -> tuple[int, ...]:
    return tuple(out.target.token_ids)


def _greedy_repeats(generate: Generate, text: str, sampling: Sampling, copies: int) -> bool:
    """Whether greedy decoding repeats itself (alone, or among `copies` copies of the prompt):
    without that, a sampled difference cannot be blamed on the seed."""
    greedy = replace(sampling, temperature=0.0, copies=True)
    if copies == 1:
        return _ids(generate([text], 0, greedy, False)) == _ids(generate([text], 0, greedy, False))
    members = generate([text] * copies, 0, greedy, True).members
    return len({tuple(m.token_ids) for m in members}) == 1


def _seed_matters(generate: Generate, texts: list[str], alone: Sampling) -> str | None:
    """The first prompt on which other seeds change the output (None: on none of them). A prompt
    the model answers with certainty shows no seed's effect, so several prompts are tried."""
    for text in texts[:PROMPTS_TRIED]:
        outputs = {_ids(generate([text], 0, replace(alone, seed=(alone.seed + k) % 2**32), False))
                   for k in range(SEEDS_TRIED)}
        if len(outputs) > 1:
            return text
    return None


def check(generate: Generate, texts: list[str], sampling: Sampling, batch_size: int) -> SeedCheck:
    """Run the control on the cell's prompts with its sampling; `batch_size` > 1 adds batch-mates."""
    seed = sampling.seed
    alone = replace(sampling, copies=False, unseeded_fillers=False)
    first, again = (_ids(generate([texts[0]], 0, alone, False)) for _ in range(2))
    if first != again:
        if not _greedy_repeats(generate, texts[0], sampling, 1):
            return SeedCheck("unrepeatable", "batch 1 does not repeat itself even greedy; the seed cannot be checked")
        return SeedCheck("ignored", f"seed {seed} twice at batch 1 gave two outputs while greedy decoding repeats: "
                                    "the seed does not fix the sampling")
    text = _seed_matters(generate, texts, alone)
    if text is None:
        tried = min(len(texts), PROMPTS_TRIED)
        return SeedCheck("ignored", f"{SEEDS_TRIED} different seeds gave one output at batch 1 on each of {tried} "
                                    f"prompt(s): the seed has no effect (or temperature {sampling.temperature} "
                                    f"leaves nothing to chance over {sampling.max_tokens} tokens: raise it)")
    mates = min(batch_size, MATES)
    if mates < 2:
        return SeedCheck(HONOURED, "")
    # each member its own seed (the target's, then fillers' derived seeds): they must not all agree
    spread = generate([text] * mates, 0, alone, True).members
    if len({tuple(m.token_ids) for m in spread}) == 1:
        return SeedCheck("shared", f"{mates} copies of one prompt with {mates} different seeds in one batch gave one "
                                   "output: the batch shares one seed")
    same = generate([text] * mates, 0, replace(alone, copies=True), True).members
    if len({tuple(m.token_ids) for m in same}) > 1:
        if not _greedy_repeats(generate, text, sampling, mates):
            return SeedCheck("unrepeatable", f"{mates} greedy copies of one prompt in one batch differ; the seed "
                                             "cannot be checked among batch-mates")
        return SeedCheck("ignored", f"{mates} copies of one prompt with seed {seed} in one batch gave different "
                                    "outputs while greedy copies agree: the seed does not fix a batch-mate's sampling")
    return SeedCheck(HONOURED, "")
