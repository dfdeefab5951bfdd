"""The exit statuses of every `pagewise` command, in one place (scripts and supervisors read them)."""

from enum import IntEnum


class ExitStatus(IntEnum):
    OK = 0
    FAILED = 1  # the command ran and what it checked failed: a bench with errors, a call the server refused
    STARTUP_ERROR = 2  # it could not start: bad flags or settings, a service out of reach (one `error:` line)
    ENGINE_DIED = 3  # a server or worker whose engine stopped under it
