"""The NCCL data plane: CUDA tensors, one broadcast collective per bucket, with a deadman.

A bucket for some receivers only (shard to shard) goes to each of them by NCCL send/recv on the
same communicator, the sends of one bucket in one NCCL group.

A collective whose peer died never completes. It must not be left to torch's watchdog, whose
default error handling ends the whole process a minute after the group's timeout. So the group
is built with the watchdog's error handling off and a group timeout far past this package's own,
and the transport carries a deadman: while an update is `armed`, a thread aborts the
communicator (`ncclCommAbort`, which makes the stuck kernels exit) the moment the deadline
passes, whatever the caller's thread is blocked in. The collectives run on a high-priority
stream, so they start the moment the previous bucket's pack/load copies allow.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Collection, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from vllm_nccl_sync.planes.base import Handle, Transport
from vllm_nccl_sync.wire.config import SyncConfig

log = logging.getLogger(__name__)

GROUP_TIMEOUT_FACTOR = 4
"""The NCCL group's own timeout is this many times `timeout_s` (+60 s): the deadman always acts
first, and torch's watchdog never judges one of our collectives."""


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    """Set environment variables for the duration (read by ProcessGroupNCCL's constructor)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class NcclTransport(Transport):
    """CUDA buckets over one NCCL broadcast each, guarded by a deadman (see the module)."""

    backend = "nccl"
    digest_per_bucket = False
    canary_bytes = 0
    reaches_some = True
    peer_harm = (
        "a peer cannot crash this process; a dead peer leaves a collective pending until the "
        "deadman aborts the communicator (armed), after which the transport is broken")

    def __init__(self, cfg: SyncConfig, rank: int, device: torch.device | None = None) -> None:
        super().__init__(cfg, rank, device)
        self.deadman.watch(self.abort, "nccl-sync-deadman")
        # Build the communicator now, inside the rendezvous timeout, not in the first bucket.
        with self.armed(cfg.timeout_s, "building the NCCL communicator"), \
                torch.cuda.device(self.device):
            self.broadcast(torch.zeros(1, dtype=torch.uint8, device=self.device)).wait()
            self.wait_stream(torch.cuda.current_stream(), cfg.timeout_s)
        self.bytes_moved = 0  # the warm-up above is not part of any update
        self.collectives = 0

    def _device(self, device: torch.device | None) -> torch.device:
        return device or torch.device("cuda", torch.cuda.current_device())

    def _group(self, store: dist.Store, cfg: SyncConfig) -> Any:
        self._timeout = timedelta(seconds=cfg.timeout_s * GROUP_TIMEOUT_FACTOR + 60)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = self._timeout
        # The collectives become runnable exactly when the previous bucket's pack/load copies
        # do; at equal priority those copies' blocks fill the GPU first and the link idles.
        opts.is_high_priority_stream = True
        # 0 = no async error handling: a failed collective never tears the process down; the
        # deadman aborts the communicator instead. No heartbeat monitor for this group.
        with _env(TORCH_NCCL_ASYNC_ERROR_HANDLING="0", TORCH_NCCL_ENABLE_MONITORING="0",
                  TORCH_NCCL_PROPAGATE_ERROR="0"):
            return dist.ProcessGroupNCCL(store, self.rank, cfg.world_size, opts)

    def _post(self, tensor: torch.Tensor, src: int, to: Collection[int] | None) -> Handle:
        if to is not None:
            return self._p2p(tensor, src, sorted(set(to) - {src}))
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        opts.timeout = self._timeout
        return self.pg.broadcast([tensor], opts)

    def _p2p(self, tensor: torch.Tensor, src: int, to: list[int]) -> Handle:
        """`tensor` from `src` to each rank of `to`, point to point (a receiver: from `src`)."""
        if self.rank != src:
            return self.pg.recv([tensor], src, 0)
        if len(to) == 1:
            return self.pg.send([tensor], to[0], 0)
        self.pg._start_coalescing(self.device)  # one NCCL group: the sends run together
        for r in to:
            self.pg.send([tensor], r, 0)
        return self.pg._end_coalescing(self.device)

    def _abort_group(self, pg: Any) -> None:
        try:
            pg.abort()  # pending collectives end at once
        except Exception:  # the group is given up either way
            log.exception("aborting the NCCL communicator failed")

    def _release(self) -> None:
        if self.broken:
            return
        self.broken = "closed"
        try:
            self.pg.abort()  # no collective is pending on a healthy group: just frees it
        except Exception:  # freed or not, it is dropped
            log.exception("freeing the NCCL communicator failed")
