"""Tables for people and for logs: model, prompt, file and error text printed as text, never as
rich markup, and nothing cut short.

A token such as `[/INST]`, or an error naming `[/path]`, would otherwise raise MarkupError in the
middle of a run, and `[word]` would vanish from the output silently. Columns fold long values onto
a second line instead of ending them in an ellipsis, and where output is not a terminal (a CI log,
`| tee`) a table is printed at its natural width (`wide_console`): a prompt id or a header is never
cut to fit 80 columns.
"""

from __future__ import annotations

import re
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

#: control characters other than newline and tab: an escape sequence in model output would restyle,
#: clear or retitle the terminal (or a CI log viewer) that shows it
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def shown(text: str) -> str:
    """`text` with control characters written out as visible escapes (\\x1b), so they cannot act."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


#: the widest a table may be drawn where output is not a terminal (no one reads wider)
LOG_WIDTH = 400


class PlainTable(Table):
    """A compact rich table whose title and string cells are plain text; pass a Text for a styled cell."""

    def __init__(self, title: str | Text | None = None, **options: Any) -> None:
        options = {"box": box.SIMPLE_HEAD, "show_edge": False, "pad_edge": False, "collapse_padding": True,
                   "title_justify": "left", "caption_justify": "left", **options}
        super().__init__(title=Text(shown(title)) if isinstance(title, str) else title, **options)

    def add_column(self, header: str = "", **options: Any) -> None:
        super().add_column(header, **{"overflow": "fold", **options})

    def add_row(self, *cells: Any, **options: Any) -> None:
        super().add_row(*(Text(shown(c)) if isinstance(c, str) else c for c in cells), **options)


def wide_console(stderr: bool = False) -> Console:
    """A console that draws tables whole: a terminal's own width, or up to LOG_WIDTH elsewhere (tables
    are only as wide as their contents, so an 80-column table stays 80 columns)."""
    console = Console(stderr=stderr, highlight=False, soft_wrap=True)
    if console.is_terminal:
        return console
    return Console(stderr=stderr, highlight=False, soft_wrap=True, width=max(console.width, LOG_WIDTH))
