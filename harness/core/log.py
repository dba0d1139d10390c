"""The one logging shape every layer passes down: a callable taking a line of text.

Engines, model conversion and runners print through whatever the caller hands them (the worker's
relay to its parent, the CLI's console), so no module owns a global logger.
"""

from __future__ import annotations

from typing import Callable

Log = Callable[[str], None]
