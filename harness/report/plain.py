"""Text from models, prompts, files and errors printed as text: never read as rich markup.

A token such as `[/INST]`, or an error naming `[/path]`, would otherwise raise MarkupError in the
middle of a run, and `[word]` would vanish from the output silently.
"""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text


class PlainTable(Table):
    """A rich table whose title and string cells are plain text; pass a Text for a styled cell."""

    def __init__(self, title: str | Text | None = None, **options: Any) -> None:
        super().__init__(title=Text(title) if isinstance(title, str) else title, **options)

    def add_row(self, *cells: Any, **options: Any) -> None:
        super().add_row(*(Text(c) if isinstance(c, str) else c for c in cells), **options)
