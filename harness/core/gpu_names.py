"""Which GPU a driver's name is: the `gpu` axis value matched by whole tokens, never by substring.

`NVIDIA A100-SXM4-80GB` splits into a vendor word (nvidia), the model (a100) and qualifiers
(sxm4, 80gb). A wanted type matches a name when their models are equal, after aliases, and
every qualifier the wanted type gives is in the name: `A100` matches every A100, `A100-80GB`
only the 80 GB ones, `A10` never an A100, `L4` never an L40S, `RTX 3090` never an RTX 3090 Ti.
"""

from __future__ import annotations

import re

#: words that name the maker or product line, not the chip
VENDOR_WORDS = frozenset({"nvidia", "tesla", "geforce", "quadro", "graphics"})
#: words that say form factor, memory or partition, not which chip it is
_QUALIFIER = re.compile(r"^(sxm\d*|pcie|nvl|nvlink|hbm\d*e?|\d+gb|mig|\d+g|\d+c|max|q)$")
#: other spellings users give -> the model words in the driver's name
ALIASES: dict[tuple[str, ...], tuple[str, ...]] = {
    ("a6000",): ("rtx", "a6000"),
    ("a5000",): ("rtx", "a5000"),
    ("a4000",): ("rtx", "a4000"),
    ("4090",): ("rtx", "4090"),
    ("3090",): ("rtx", "3090"),
    ("6000", "ada"): ("rtx", "6000", "ada", "generation"),
    ("rtx", "6000", "ada"): ("rtx", "6000", "ada", "generation"),
}


def _words(name: str) -> list[str]:
    return [w for w in re.split(r"[^0-9a-z]+", name.lower()) if w]


def parse(name: str) -> tuple[tuple[str, ...], frozenset[str]]:
    """(model words, qualifier words) of a GPU name, vendor words dropped."""
    words = [w for w in _words(name) if w not in VENDOR_WORDS]
    model = tuple(w for w in words if not _QUALIFIER.match(w))
    qualifiers = frozenset(w for w in words if _QUALIFIER.match(w))
    return ALIASES.get(model, model), qualifiers


def matches(wanted: str, driver_name: str) -> bool:
    """True when the driver's GPU is the wanted type (see the module doc)."""
    want_model, want_quals = parse(wanted)
    have_model, have_quals = parse(driver_name)
    return bool(want_model) and want_model == have_model and want_quals <= have_quals
