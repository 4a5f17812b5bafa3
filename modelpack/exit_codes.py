"""The exit status of every modelpack command, in one table.

Scripts and CI branch on these, so they are a contract like ``--json``: README's "Exit status"
table is this table (a test compares them) and each status is produced by a real case in
tests/cli/test_exit_codes.py. A signal ends a command as a shell reports a process it killed
(128 + the signal number), after every temp file and staging directory is removed.
"""

from __future__ import annotations

import signal
from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILURE = 1
    USAGE = 2
    SIGHUP = 128 + signal.SIGHUP
    SIGINT = 128 + signal.SIGINT
    OUTPUT_CLOSED = 128 + signal.SIGPIPE
    SIGTERM = 128 + signal.SIGTERM


#: what each status means, as README shows it
MEANING: dict[ExitCode, str] = {
    ExitCode.OK: "success",
    ExitCode.FAILURE: "the command failed or refused: a signature or policy refusal, a digest mismatch, "
    "a missing tag, a registry that refused the credentials, a network or disk failure",
    ExitCode.USAGE: "usage: a flag, argument, reference, policy file or setting that cannot be used as given",
    ExitCode.SIGHUP: "stopped by SIGHUP (a closed terminal); temp files removed, partial downloads kept to resume",
    ExitCode.SIGINT: "stopped by SIGINT (Ctrl-C); temp files removed, partial downloads kept to resume",
    ExitCode.OUTPUT_CLOSED: "stdout or stderr was closed under the command (its reader, e.g. `head`, left)",
    ExitCode.SIGTERM: "stopped by SIGTERM (a CI timeout, a pod stopped); temp files removed, partial downloads kept to resume",
}


def for_signal(signum: int) -> int:
    """The status a command ends with on ``signum`` (128 + its number, as a shell reports it)."""
    return 128 + int(signum)
