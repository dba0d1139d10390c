"""The one user-facing error type, caught once in the CLI."""


class HarnessError(Exception):
    """An error the user can fix; its message is printed without a traceback."""

    exit_code = 1


class ConfigError(HarnessError):
    """Bad experiment or prompt file: nothing has been run or written."""

    exit_code = 2


class UsageError(HarnessError):
    """A bad command-line argument (a selection, a reference): refused before anything runs or is written."""

    exit_code = 2
