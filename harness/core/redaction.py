"""Credentials never reach what the harness stores: rows, manifests, experiment copies, cell ids, logs.

Engine options may carry them (`openai.launch: [..., --api-key, X]`, a `base_url` with
`user:password@`, `vllm.extra.hf_token`, `llama-server.extra_args`). Which values are secret is
decided by rule, not by a list of known options: a key or flag whose name has a credential word in
it, the user information of a URL, and a URL query parameter so named. The engine still receives
the real values; only what is written is redacted. A redacted value is the same text whatever the
secret, so a new key never changes a cell id.

A value may name an environment variable instead, `${NAME}` (an option, a flag's value, a URL's
password): that reference is stored as written and filled in by the worker at run time
(`expand`), so a batch job that runs the stored snapshot gets the secret from its environment.
Text that may quote a secret (an error, a log line, a setup line) goes through `redact_text`.
"""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path
from typing import Any

REDACTED = "<redacted>"

#: words of a name that mark its value as a credential ('hf_token', 'api-key', 'PASSWD', 'auth')
_WORDS = {"key", "apikey", "token", "secret", "password", "passwd", "pass", "pwd", "auth", "authorization",
          "credential", "credentials", "bearer", "cookie", "private"}
#: short flags that carry a credential though no word of theirs says so (llama.cpp's -hft: --hf-token)
_SHORT_FLAGS = {"hft"}
#: names ending so hold the *name* of an environment variable, never the secret itself
_NAMES_A_VARIABLE = ("_env", "_env_var", "-env")
#: a reference to an environment variable, filled in at run time: `${NAME}`
_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def is_reference(value: Any) -> bool:
    """Whether `value` is, as a whole, a reference to an environment variable (kept as written)."""
    return isinstance(value, str) and _REFERENCE.fullmatch(value) is not None


def references(value: Any) -> list[str]:
    """The environment variables `value` (options, nested) names as `${NAME}`, in order."""
    if isinstance(value, dict):
        return list(dict.fromkeys(n for v in value.values() for n in references(v)))
    if isinstance(value, (list, tuple)):
        return list(dict.fromkeys(n for v in value for n in references(v)))
    return _REFERENCE.findall(value) if isinstance(value, str) else []


def expand(value: Any, environ: dict[str, str], where: str = "engine_options") -> Any:
    """`value` with every `${NAME}` replaced by the variable's value in `environ`; a KeyError-free
    ValueError that names the variable and where it is used when one is not set."""
    if isinstance(value, dict):
        return {k: expand(v, environ, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [expand(v, environ, f"{where}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value

    def fill(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in environ:
            raise ValueError(f"{where} names ${{{name}}}, which is not set in this environment: export {name} "
                             "where the run starts (a batch job gets the environment 'harness submit' ran in)")
        return environ[name]

    return _REFERENCE.sub(fill, value)


def expanded_secrets(value: Any, environ: dict[str, str]) -> set[str]:
    """The values `value`'s references take from `environ`: they are secrets (the reason to refer)."""
    return {environ[n] for n in references(value) if environ.get(n)}


def secret_name(name: str) -> bool:
    """Whether an option key, flag or parameter named `name` carries a credential."""
    lowered = name.strip().lstrip("-").lower()
    if not lowered or lowered.endswith(_NAMES_A_VARIABLE):
        return False
    words = [w for w in re.split(r"[^a-z0-9]+", lowered) if w]
    if lowered in _SHORT_FLAGS:
        return True
    return any(w in _WORDS or w.endswith(("token", "secret", "password", "apikey")) for w in words)


#: a URL in free text (a description, an error, a log line): it ends at whitespace or a quote
_URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]+")
#: a query parameter of a URL ('?api_key=X', '&token=X')
_QUERY = re.compile(r"([?&;])([^=&#;\s]+)=([^&#;\s]*)")


def _userinfo_end(rest: str) -> int:
    """Where a URL's user information ends (the index of its '@'), -1 without one: the last '@' of the
    URL, since a password may hold '/', '?', '#' or '@' unescaped ('u:pa/ss@host'), so the host is what
    follows the last '@', never what a parser takes for the first path segment. An '@' further on (an
    address in a query) hides more than it must, never less."""
    return rest.rfind("@")


def redact_url(text: str) -> str:
    """A URL without its user information and without the values of credential query parameters; text
    around it kept. Nothing to hide: the URL as written (so ids of such options never change)."""
    if "://" not in text:
        return text
    scheme, _, rest = text.partition("://")
    at = _userinfo_end(rest)
    if at >= 0 and not _referred_userinfo(rest[:at]):
        rest = f"{REDACTED}{rest[at:]}"

    def query(match: re.Match[str]) -> str:
        lead, name, value = match.groups()
        hidden = secret_name(name) and value and not is_reference(value) and value != REDACTED
        return f"{lead}{name}={REDACTED}" if hidden else match.group(0)

    return f"{scheme}://{_QUERY.sub(query, rest)}"


def hide_urls(text: str) -> str:
    """Free text with every URL in it through redact_url, the text around each kept as written."""
    return _URL.sub(lambda m: redact_url(m.group(0)), text) if "://" in text else text


def _referred_userinfo(userinfo: str) -> bool:
    """Whether a URL's user:password names its password as `${NAME}` (and holds no other secret)."""
    user, colon, password = userinfo.partition(":")
    return bool(colon) and is_reference(password) and not user.startswith(("sk-", "hf_"))


def _args(items: list[Any]) -> list[Any]:
    """An argument list with the value of every credential flag redacted (`--api-key X`, `--token=X`)."""
    out: list[Any] = []
    hide_next = False
    for item in items:
        if hide_next:
            out.append(item if is_reference(item) else REDACTED)
            hide_next = False
            continue
        if isinstance(item, str) and item.startswith("-"):
            flag, eq, value = item.partition("=")
            if secret_name(flag):
                out.append(f"{flag}={REDACTED}" if eq and not is_reference(value) else item)
                hide_next = not eq
                continue
        out.append(redact(item))
    return out


def redact(value: Any, name: str = "") -> Any:
    """`value` as it may be stored: credentials replaced by REDACTED, everything else as it was."""
    if name and secret_name(name) and value not in (None, "", [], {}) and not is_reference(value):
        return REDACTED
    if isinstance(value, dict):
        return {k: redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return _args(list(value))
    if isinstance(value, str):
        return redact_text(value)  # one rule for every string: its shapes, URLs, flags and assignments
    return value


def secret_values(value: Any, name: str = "") -> set[str]:
    """The credential strings inside `value` (what `redact` hides), to scrub them from text."""
    if isinstance(value, dict):
        return set().union(*(secret_values(v, str(k)) for k, v in value.items())) if value else set()
    if name and secret_name(name) and isinstance(value, (str, int)) and str(value) and not is_reference(value):
        return {str(value)}
    if isinstance(value, (list, tuple)):
        found: set[str] = set()
        for item, shown in zip(value, _args(list(value))):
            found |= secret_values(item) if shown != REDACTED else {str(item)}
            if isinstance(item, str) and isinstance(shown, str) and shown.endswith("=" + REDACTED):
                found.add(item.partition("=")[2])
        return found
    if isinstance(value, str) and "://" in value:
        found: set[str] = set()
        for url in _URL.findall(value):
            rest = url.partition("://")[2]
            at = _userinfo_end(rest)
            if at >= 0 and not _referred_userinfo(rest[:at]):
                found.add(rest[:at])
                found.add(rest[:at].partition(":")[2])
            found |= {v for _, k, v in _QUERY.findall(rest) if secret_name(k) and v and not is_reference(v)}
        return {f for f in found if f}
    if isinstance(value, str):
        return set(_BARE.findall(value))
    return set()


#: an HTTP authorization scheme and its credential, wherever it stands ('Bearer X', 'token: Basic X')
_SCHEME = re.compile(r"(?i)\b(bearer|basic)(\s+)([A-Za-z0-9._~+/=-]{8,})")
#: an HTTP credential header, as a log or a repr writes it ('Authorization: Bearer X', {'x-api-key': 'X'})
_HEADER = re.compile(r"(?i)\b((?:proxy-)?authorization|x-api-key|api-key)(['\"]?\s*[:=]\s*['\"]?)"
                     r"((?:bearer|basic|token)\s+)?([^\s'\",}]+)")
#: NAME=value, NAME: value, "NAME": "value" (a setup line, an environment dump, a JSON or repr)
_ASSIGNMENT = re.compile(r"(?<![\w$-])([A-Za-z_][A-Za-z0-9_.-]*)(['\"]?\s*[=:]\s*['\"]?)([^\s'\",}&;)]+)")
#: --flag value / --flag=value of a command line
_FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][A-Za-z0-9-]*)(=|\s+)(?=[^\s-])([^\s'\"]+)")


#: credentials recognisable by their own shape, wherever they stand in a text: Hugging Face, OpenAI
#: and Anthropic style keys, GitHub and GitLab tokens, Slack tokens, AWS access key ids, JWTs
_BARE = re.compile(r"(?<![A-Za-z0-9_-])(?:hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,}|gh[pousr]_[A-Za-z0-9]{20,}"
                   r"|github_pat_[A-Za-z0-9_]{20,}|glpat-[A-Za-z0-9_-]{20,}|xox[abprs]-[A-Za-z0-9-]{10,}"
                   r"|AKIA[0-9A-Z]{16}|eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,})")


def hide_shapes(text: str) -> str:
    """Text with the credentials recognisable by shape alone hidden, whatever field or option holds it:
    tokens of the usual shapes (_BARE), URL user information and credential query values, and the
    credential of an HTTP authorization scheme ('Bearer X'); the text around each kept."""
    text = hide_urls(_BARE.sub(REDACTED, text))
    return _SCHEME.sub(lambda m: m.group(0) if m.group(3).startswith("$") else f"{m.group(1)}{m.group(2)}{REDACTED}",
                       text)


def has_credential(text: str) -> bool:
    """Whether free text holds something redact_text would hide."""
    return isinstance(text, str) and redact_text(text) != text


def redact_text(text: str, secrets: set[str] | frozenset[str] = frozenset()) -> str:
    """Free text (an error, a log line, a shell line) as it may be stored: every known secret value
    (4 characters or more), tokens of the usual shapes (_BARE), URL user information, credential
    headers, and the values of credential names and flags (values of six characters or more, not
    all digits) replaced by REDACTED. A value written as an environment reference ($NAME, ${NAME})
    is kept: it is no secret, and a job needs it as written."""
    if not isinstance(text, str) or not text:
        return text
    for secret in sorted((s for s in secrets if len(s) >= 4), key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    text = hide_shapes(text)
    text = _HEADER.sub(lambda m: f"{m.group(1)}{m.group(2)}{m.group(3) or ''}{REDACTED}"
                       if not m.group(4).startswith("$") else m.group(0), text)

    def hide(match: re.Match[str]) -> str:
        name, sep, value = match.groups()
        # short or numeric values pass: 'EOS token = 2' in a llama.cpp log is no credential
        if (not secret_name(name) or value.startswith("$") or value == REDACTED or "://" in value
                or len(value) < 6 or value.isdigit() or value.lower() in ("bearer", "basic")):
            return match.group(0)
        return f"{name}{sep}{REDACTED}"

    return _FLAG.sub(hide, _ASSIGNMENT.sub(hide, text))


def redact_rows(rows: list[dict[str, Any]], secrets: set[str] | frozenset[str] = frozenset(),
                columns: tuple[str, ...] = ("error", "engine_info")) -> list[dict[str, Any]]:
    """Rows with the free-text columns that may quote a credential (an error's text, an engine's
    description) through redact_text, each distinct text once (a cell's rows share one engine_info)."""
    done: dict[str, str] = {}

    def clean(text: str) -> str:
        if text not in done:
            done[text] = redact_text(text, secrets)
        return done[text]

    return [r | {c: clean(r[c]) for c in columns if isinstance(r.get(c), str) and r[c]} for r in rows]


def scrub(path: Path, secrets: set[str]) -> None:
    """Replace every secret in a text file (a server's or worker's log) by REDACTED, in place."""
    if not path.is_file():
        return
    text = path.read_text(encoding="utf-8", errors="replace")
    clean = redact_text(text, secrets)
    if clean != text:
        path.write_text(clean, encoding="utf-8")


class RedactingStream(io.TextIOBase):
    """A text stream (the process's stdout or stderr) that writes every line through hide_shapes: the
    one place every printed string leaves the harness, whatever printed it (a table, an error, a
    library's warning), so a credential recognisable by its shape is never shown. Text is held until
    its line ends (a shape split over two writes is still one), and written at a flush as it stands."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner
        self._held = ""

    def write(self, text: str) -> int:
        self._held += text
        end = max(self._held.rfind("\n"), self._held.rfind("\r"))
        if end >= 0:
            done, self._held = self._held[:end + 1], self._held[end + 1:]
            self.inner.write(hide_shapes(done))
        return len(text)

    def flush(self) -> None:
        if self._held:
            held, self._held = self._held, ""
            self.inner.write(hide_shapes(held))
        self.inner.flush()

    def isatty(self) -> bool:
        return self.inner.isatty()

    def fileno(self) -> int:
        return self.inner.fileno()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.inner, "encoding", "utf-8")

    @property
    def errors(self) -> str | None:  # type: ignore[override]
        return getattr(self.inner, "errors", None)


def redact_standard_streams() -> None:
    """Put the process's stdout and stderr behind RedactingStream (once)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, RedactingStream):
            setattr(sys, name, RedactingStream(stream))
