"""Small helpers shared across the core (one definition each)."""
from __future__ import annotations

import signal


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the blocks that ``a`` tokens need at ``b`` tokens per block."""
    return -(-a // b)


def describe_exit(exitcode: int | None) -> str:
    """How a child process ended, in the words every error and log line uses ("killed by signal SIGKILL")."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"
