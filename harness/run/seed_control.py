"""Seed control: at temperature > 0, does the cell's seed take effect before its runs are measured?

Sampled runs can only be compared if the seed fixes the sampling. Engines and servers differ:
some ignore `seed` (SGLang's OpenAI endpoints, sglang #15481), some broadcast one seed over a
whole batch (vLLM #50440: every prompt of a batch got the same noise). Either way differences
would be measured as non-determinism when they are the seed's doing. The control runs the cell's
first prompts a few times before the cell: the same seed must agree with itself (twice, then 24
times on a prompt where seeds matter), different seeds must not all agree, alone and among
batch-mates. A seed that fails is reported as such (the cell is 'unsupported'
with the reason), never measured.

"Shared" is declared only on evidence chance cannot give: batch-mates whose own seeds were shown,
alone, to give different outputs, and yet agree inside one batch, in each of `SHARED_TRIALS`
batches. Independent seeds agreeing is no evidence: on a prompt a model answers one way five times
in six, four independent seeds agree about half the time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from harness.engines.base import BatchOutput, Sampling

#: generate(prompts, target, sampling, members) -> the batch's output
Generate = Callable[[list[str], int, Sampling, bool], BatchOutput]

#: different seeds tried on a prompt, and prompts tried, before "the seed has no effect" is concluded:
#: on a prompt answered one way five times in six, 24 seeds all agree by chance 1.3% of the time
SEEDS_TRIED = 24
PROMPTS_TRIED = 3
#: copies of one prompt in the batch-mates control (at most the cell's batch size)
MATES = 4

#: batches (each with mates shown to differ alone) that must all agree before "shared" is declared
SHARED_TRIALS = 3

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


def _same_seed_outputs(generate: Generate, text: str, alone: Sampling) -> int:
    """Distinct outputs of the same seed asked SEEDS_TRIED times on `text` (stops at the second one).
    Two unseeded draws agree by chance as often as a prompt is predictable (on a five-in-six prompt,
    72% of the time); all 24 agree 1.3% of the time."""
    seen: set[tuple[int, ...]] = set()
    for _ in range(SEEDS_TRIED):
        seen.add(_ids(generate([text], 0, alone, False)))
        if len(seen) > 1:
            break
    return len(seen)


def _mates_alone(generate: Generate, text: str, batch: Sampling, mates: int) -> list[tuple[int, ...]]:
    """Each member's output alone, under the seed it gets in a batch of `mates` copies (`batch`'s target
    seed at position 0, the fillers' derived seeds after it)."""
    return [_ids(generate([text], 0, replace(batch, seed=batch.seed_for(i, 0)), False)) for i in range(mates)]


def _shared_seed(generate: Generate, text: str, alone: Sampling, mates: int) -> str | None:
    """Why the batch shares one seed, or None. Tried on base seeds whose mates differ alone; every one
    of SHARED_TRIALS such batches must agree, and one that disagrees clears the engine. Without base
    seeds whose mates differ alone (a prompt of very low entropy) nothing is concluded: None."""
    trials = 0
    for k in range(SEEDS_TRIED):
        batch = replace(alone, seed=(alone.seed + 104729 * k) % 2**32)
        if len(set(_mates_alone(generate, text, batch, mates))) < 2:
            continue  # these mates' own seeds agree alone: their agreement in a batch would prove nothing
        if len({tuple(m.token_ids) for m in generate([text] * mates, 0, batch, True).members}) > 1:
            return None
        trials += 1
        if trials == SHARED_TRIALS:
            return (f"{SHARED_TRIALS} batches of {mates} copies of one prompt, each copy with its own seed, gave one "
                    f"output per batch, though those seeds alone gave different outputs: the batch shares one seed")
    return None


def _unfixed_alone(generate: Generate, text: str, sampling: Sampling, seen: str) -> SeedCheck:
    """The verdict when one seed gave several outputs alone (`seen` says how): ignored, unless greedy
    decoding does not repeat either, when nothing can be blamed on the seed."""
    if not _greedy_repeats(generate, text, sampling, 1):
        return SeedCheck("unrepeatable", "batch 1 does not repeat itself even greedy; the seed cannot be checked")
    return SeedCheck("ignored", f"{seen} while greedy decoding repeats: the seed does not fix the sampling (as a "
                                "server that ignores a request's seed samples anew each time: SGLang unless started "
                                "with --enable-deterministic-inference)")


def check(generate: Generate, texts: list[str], sampling: Sampling, batch_size: int) -> SeedCheck:
    """Run the control on the cell's prompts with its sampling; `batch_size` > 1 adds batch-mates."""
    seed = sampling.seed
    alone = replace(sampling, copies=False, unseeded_fillers=False)
    first, again = (_ids(generate([texts[0]], 0, alone, False)) for _ in range(2))
    if first != again:
        return _unfixed_alone(generate, texts[0], sampling, f"seed {seed} twice at batch 1 gave two outputs")
    text = _seed_matters(generate, texts, alone)
    if text is None:
        tried = min(len(texts), PROMPTS_TRIED)
        return SeedCheck("ignored", f"{SEEDS_TRIED} different seeds gave one output at batch 1 on each of {tried} "
                                    f"prompt(s): the seed has no effect (or temperature {sampling.temperature} "
                                    f"leaves nothing to chance over {sampling.max_tokens} tokens: raise it)")
    repeated = _same_seed_outputs(generate, text, alone)
    if repeated > 1:  # the first pair agreed by chance: on a low-entropy prompt an unseeded pair often does
        return _unfixed_alone(generate, text, sampling, f"seed {seed} {SEEDS_TRIED} times at batch 1 gave {repeated} "
                                                        "outputs on a prompt where other seeds change the output")
    mates = min(batch_size, MATES)
    if mates < 2:
        return SeedCheck(HONOURED, "")
    shared = _shared_seed(generate, text, alone, mates)
    if shared is not None:
        return SeedCheck("shared", shared)
    same = generate([text] * mates, 0, replace(alone, copies=True), True).members
    if len({tuple(m.token_ids) for m in same}) > 1:
        if not _greedy_repeats(generate, text, sampling, mates):
            return SeedCheck("unrepeatable", f"{mates} greedy copies of one prompt in one batch differ; the seed "
                                             "cannot be checked among batch-mates")
        return SeedCheck("ignored", f"{mates} copies of one prompt with seed {seed} in one batch gave different "
                                    "outputs while greedy copies agree: the seed does not fix a batch-mate's sampling")
    return SeedCheck(HONOURED, "")
