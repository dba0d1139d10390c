"""The one user-facing error type, caught once in the CLI."""

import errno
import re


class HarnessError(Exception):
    """An error the user can fix; its message is printed without a traceback."""

    exit_code = 1


class ConfigError(HarnessError):
    """Bad experiment or prompt file: nothing has been run or written."""

    exit_code = 2


class UsageError(HarnessError):
    """A bad command-line argument (a selection, a reference): refused before anything runs or is written."""

    exit_code = 2


def describe_os_error(exc: OSError) -> str:
    """One line for a failed file operation: which file, why, and what to do (pyarrow's OSErrors
    carry the errno only in their text)."""
    code = exc.errno
    if code is None:
        found = re.search(r"\[errno (\d+)\]", str(exc))
        code = int(found.group(1)) if found else None
    where = " -> ".join(str(f) for f in (exc.filename, exc.filename2) if f)
    text = f"{where}: {exc.strerror}" if where and exc.strerror else str(exc)
    if code in (errno.EROFS, errno.EACCES, errno.EPERM):
        return (f"{text} (read-only or not writable here: nothing was changed there; readers take --out to "
                "write their output elsewhere)")
    if code in (errno.ENOSPC, errno.EDQUOT):
        return (f"{text} (the disk or quota is full: cells that finished before are kept whole; free space and "
                "run the same command again to go on)")
    return text
