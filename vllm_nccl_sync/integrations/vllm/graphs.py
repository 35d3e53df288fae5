"""Replays that repeat, captured: a batch whose copies are the very same as before (same
recorded entries, same source addresses, same checksum taps) is queued as one CUDA graph launch.

A replayed `load_weights` is plain copies (`copyplan`), but each still costs Python: a view, a
`copy_` call and its checks per write, for every tensor of every update. A trainer pushing its
own parameters step after step, or a shadow swap, repeats exactly the same copies every update:
the second time a batch is seen its copies are captured into a CUDA graph (which runs nothing)
and the graph is launched; every later time the launch alone. What the capture returned (the
checksum terms a copy computed: tensors the graph writes each launch) is handed back as it was.

A graph bakes in addresses: a batch's key holds everything its copies' addresses come from
(each entry, kept alive by the cache, and each source's address; the entries' parameters are
checked valid before the key is made). Memory a graph reads that is not in the key (a checksum
kernel's table) is kept referenced with it. Any capture that fails turns capturing off for the
plan, with the reason (`off`), and the batch is replayed as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import torch

log = logging.getLogger(__name__)
R = TypeVar("R")
_LIMIT = 64
"""Graphs kept (one per distinct batch: an update read in place is one batch)."""


class CapturedReplays:
    """Per batch key, the CUDA graph of its copies and what its capture returned."""

    def __init__(self) -> None:
        self.off = ""
        """Why batches are no longer captured ("" while they are)."""
        self.launched = 0
        """Batches queued as a graph launch (since its owner last set it to 0)."""
        self._graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, Any, list[Any]]] = {}
        self._seen: set[Hashable] = set()
        self._stream: torch.cuda.Stream | None = None

    def clear(self) -> None:
        """Forget every graph (the recorded copies changed)."""
        self._graphs.clear()
        self._seen.clear()

    def run(self, key: Hashable, device: torch.device, queue: Callable[[], R],
            keep: Callable[[], list[Any]]) -> R:
        """What `queue()` returns, its CUDA work queued on the current stream: as a graph
        launch where the batch was captured before, captured now where it is seen the second
        time, else by `queue` itself. `keep()` lists memory the captured work reads that the
        key does not hold (kept referenced while the graph lives)."""
        got = self._graphs.get(key)
        if got is not None:
            got[0].replay()
            self.launched += 1
            return got[1]
        if self.off:
            return queue()
        if key not in self._seen:
            if len(self._seen) >= 4 * _LIMIT:
                self._seen.clear()
            self._seen.add(key)
            return queue()
        captured = self._capture(device, queue)
        if captured is None:
            return queue()
        if len(self._graphs) >= _LIMIT:
            self._graphs.clear()
        self._graphs[key] = (*captured, keep())
        captured[0].replay()
        self.launched += 1
        return captured[1]

    def _capture(self, device: torch.device, queue: Callable[[], R]
                 ) -> tuple[torch.cuda.CUDAGraph, R] | None:
        """`queue`'s work captured (not run) on a stream of its own, or None (`off` set)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(self._stream):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    out = queue()
                finally:
                    graph.capture_end()
        except Exception as e:  # noqa: BLE001 - an op that cannot be captured: run it as before
            self.off = f"capturing a replay failed: {e!r}"
            log.warning("replayed loads are no longer captured as CUDA graphs: %s", self.off)
            self.clear()
            return None
        return graph, out
