"""The deadman: a deadline armed around an update and, on a plane whose collectives can hang
(NCCL), a thread that acts on it.

While a block is `armed`, the deadline stands; `extend` pushes it on (a new phase of the same
update); leaving the block disarms it. A plane whose collectives time out on their own (gloo)
only records the deadline. A plane that `watch`es it gets a thread that calls its abort the
moment the deadline passes, whatever the caller's thread is blocked in (a stream sync behind a
collective that will never complete), so the abort itself ends the wait.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator


class Deadman:
    """An armed deadline (`armed`, `extend`) and, once `watch`ed, the thread that acts on it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.deadline: float | None = None
        """When the armed block must be done (`time.monotonic()`); None while disarmed."""
        self._what = ""
        self._closed = False

    @contextlib.contextmanager
    def armed(self, seconds: float, what: str) -> Iterator[None]:
        """The block (`what`, named in the abort's reason) must be done within `seconds`."""
        with self._cond:
            self.deadline, self._what = time.monotonic() + seconds, what
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                self.deadline = None

    def extend(self, seconds: float) -> None:
        """Push an armed deadline to `seconds` from now (nothing while disarmed)."""
        with self._cond:
            if self.deadline is not None:
                self.deadline = time.monotonic() + seconds
                self._cond.notify()

    def watch(self, on_expiry: Callable[[str], None], name: str) -> threading.Thread:
        """Start the thread (daemon, `name`) that calls `on_expiry(reason)` once an armed
        deadline has passed (then the deadline is disarmed); it ends on `close`."""
        thread = threading.Thread(target=self._run, args=(on_expiry,), name=name, daemon=True)
        thread.start()
        return thread

    def _run(self, on_expiry: Callable[[str], None]) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                if self.deadline is None:
                    self._cond.wait()
                    continue
                left = self.deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                what, self.deadline = self._what, None
            on_expiry(f"{what} did not finish within the deadline")

    def close(self) -> None:
        """Disarm for good; a watching thread ends."""
        with self._cond:
            self._closed = True
            self.deadline = None
            self._cond.notify()
