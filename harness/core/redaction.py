"""Credentials never reach what the harness stores: rows, manifests, experiment copies, cell ids, logs.

Engine options may carry them (`openai.launch: [..., --api-key, X]`, a `base_url` with
`user:password@`, `vllm.extra.hf_token`, `llama-server.extra_args`). Which values are secret is
decided by rule, not by a list of known options: a key or flag whose name has a credential word in
it, the user information of a URL, and a URL query parameter so named. The engine still receives
the real values; only what is written is redacted. A redacted value is the same text whatever the
secret, so a new key never changes a cell id.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

REDACTED = "<redacted>"

#: words of a name that mark its value as a credential ('hf_token', 'api-key', 'PASSWD', 'auth')
_WORDS = {"key", "apikey", "token", "secret", "password", "passwd", "pass", "pwd", "auth", "authorization",
          "credential", "credentials", "bearer", "cookie", "private"}
#: names ending so hold the *name* of an environment variable, never the secret itself
_NAMES_A_VARIABLE = ("_env", "_env_var", "-env")


def secret_name(name: str) -> bool:
    """Whether an option key, flag or parameter named `name` carries a credential."""
    lowered = name.strip().lstrip("-").lower()
    if not lowered or lowered.endswith(_NAMES_A_VARIABLE):
        return False
    words = [w for w in re.split(r"[^a-z0-9]+", lowered) if w]
    return any(w in _WORDS or w.endswith(("token", "secret", "password", "apikey")) for w in words)


def redact_url(text: str) -> str:
    """A URL without its user information and without the values of credential query parameters."""
    if "://" not in text:
        return text
    try:
        parts = urlsplit(text)
    except ValueError:
        return text
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    if "@" not in parts.netloc and not any(secret_name(k) for k, _ in pairs):
        return text  # nothing to hide: the URL as written (so ids of such options never change)
    netloc = f"{REDACTED}@{parts.netloc.rsplit('@', 1)[1]}" if "@" in parts.netloc else parts.netloc
    query = urlencode([(k, REDACTED if secret_name(k) else v) for k, v in pairs], safe="<>") if pairs else ""
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _args(items: list[Any]) -> list[Any]:
    """An argument list with the value of every credential flag redacted (`--api-key X`, `--token=X`)."""
    out: list[Any] = []
    hide_next = False
    for item in items:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        if isinstance(item, str) and item.startswith("-"):
            flag, eq, _ = item.partition("=")
            if secret_name(flag):
                out.append(f"{flag}={REDACTED}" if eq else item)
                hide_next = not eq
                continue
        out.append(redact(item))
    return out


def redact(value: Any, name: str = "") -> Any:
    """`value` as it may be stored: credentials replaced by REDACTED, everything else as it was."""
    if name and secret_name(name) and value not in (None, "", [], {}):
        return REDACTED
    if isinstance(value, dict):
        return {k: redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return _args(list(value))
    if isinstance(value, str):
        return redact_url(value)
    return value


def secret_values(value: Any, name: str = "") -> set[str]:
    """The credential strings inside `value` (what `redact` hides), to scrub them from text."""
    if isinstance(value, dict):
        return set().union(*(secret_values(v, str(k)) for k, v in value.items())) if value else set()
    if name and secret_name(name) and isinstance(value, (str, int)) and str(value):
        return {str(value)}
    if isinstance(value, (list, tuple)):
        found: set[str] = set()
        for item, shown in zip(value, _args(list(value))):
            found |= secret_values(item) if shown != REDACTED else {str(item)}
            if isinstance(item, str) and isinstance(shown, str) and shown.endswith("=" + REDACTED):
                found.add(item.partition("=")[2])
        return found
    if isinstance(value, str) and "://" in value:
        parts = urlsplit(value)
        found = {parts.netloc.rsplit("@", 1)[0]} if "@" in parts.netloc else set()
        if parts.password:
            found.add(parts.password)
        return found | {v for k, v in parse_qsl(parts.query) if secret_name(k) and v}
    return set()


def scrub(path: Path, secrets: set[str]) -> None:
    """Replace every secret in a text file (a server's or worker's log) by REDACTED, in place."""
    secrets = {s for s in secrets if len(s) >= 4}  # shorter strings would scrub ordinary text
    if not secrets or not path.is_file():
        return
    text = path.read_text(encoding="utf-8", errors="replace")
    clean = text
    for secret in sorted(secrets, key=len, reverse=True):
        clean = clean.replace(secret, REDACTED)
    if clean != text:
        path.write_text(clean, encoding="utf-8")
