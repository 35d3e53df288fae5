"""The one wait rule of both sides: every wait takes its remaining time from one deadline.

A wait (a join, a control round, the coordinator's verdict, a receiver's next message) starts a
`Deadline` and passes it down; each look at a socket is given what is left of it, so nothing
that arrives meanwhile (a message of another update, a stale answer) extends it. The engine
side's waits are `engine/inbox.py`'s `Wait`, a `Deadline` that says what it waits for.
"""

from __future__ import annotations

import time


class Deadline:
    """`seconds` from now, as an absolute point on the monotonic clock (`at`)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        """The seconds left (0 once it passed)."""
        return max(self.at - time.monotonic(), 0.0)

    def passed(self) -> bool:
        return time.monotonic() > self.at
