"""The gloo data plane: CPU tensors, the sender sending each receiver its bytes point to point.

gloo's own broadcast relays through a tree, and a relay forwards whatever size it posted; point
to point, a receiver can post its whole buffer and gets exactly what was sent (and a bucket for
some receivers only goes to them alone: `reaches_some`). Each pair of ranks tags its transfers
by their count between the two of them, so a receiver that joins only its own buckets stays in
step with the sender. Collectives time
out on their own (`timeout_s`), so there is no deadman; a peer whose transfer failed is `lost`
and later broadcasts skip it, so a receiver that died does not stop the others from getting
every bucket they agreed to. gloo refuses at once a send to a peer whose connection it saw
close: that peer alone is skipped, and its failure is raised when the broadcast is waited for
(had it ended the broadcast, the peers after it would miss the bucket and, their counts then
behind the sender's, take the next bucket's bytes for it).
"""

from __future__ import annotations

import os
from collections.abc import Collection
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from vllm_nccl_sync.outcomes import PeerFailed
from vllm_nccl_sync.planes.base import Handle, Transport
from vllm_nccl_sync.planes.rendezvous import local_address
from vllm_nccl_sync.wire.config import SyncConfig


class _Works:
    """Gloo point-to-point operations, one per peer, as one handle; `wait` is bounded.

    A failed peer does not hold up the others: every operation is waited for, the failed peers
    are added to `lost` (the transport's, so later broadcasts skip them), and the first failure
    is raised (`PeerFailed`), one that failed as it was posted included."""

    def __init__(self, works: dict[int, Any], timeout: timedelta, lost: set[int],
                 failed: dict[int, RuntimeError] | None = None) -> None:
        """`failed`: the peers whose operation could not even be posted, and why."""
        self._works = works
        self._timeout = timeout
        self._lost = lost
        self._failed = failed or {}

    def wait(self) -> bool:
        failed, self._failed = list(self._failed.items()), {}
        for rank, w in self._works.items():
            try:
                w.wait(self._timeout)
            except RuntimeError as e:
                failed.append((rank, e))
        self._works = {}
        if failed:
            self._lost.update(r for r, _ in failed)
            rank, e = failed[0]
            raise PeerFailed(f"data-plane transfer with rank {rank} failed: {e}", rank) from e
        return True


class GlooTransport(Transport):
    """CPU buckets over gloo point-to-point sends (see the module docstring)."""

    backend = "gloo"
    digest_per_bucket = True
    canary_bytes = 8
    reaches_some = True
    peer_harm = (
        "a broadcast longer than the receiver's whole bucket buffer aborts the receiving process "
        "inside gloo (EnforceNotMet ... op.preamble.length <= op.nbytes, exit -6), with no way "
        "around it on gloo (receive_process moves that to a process of the worker's own); a "
        "longer one that still fits the posted buffer is caught by the canary; a dead peer "
        "fails its transfers at the group's timeout and is skipped after")

    def _device(self, device: torch.device | None) -> torch.device:
        return torch.device("cpu")

    def _group(self, store: dist.Store, cfg: SyncConfig) -> Any:
        self._timeout = timedelta(seconds=cfg.timeout_s)
        self._tags: dict[int, int] = {}
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = self._timeout
        # Each rank binds an address of its own host: the trainer its configured one, a
        # receiver the one that routes to the trainer (GLOO_SOCKET_IFNAME overrides both).
        ifname = os.environ.get("GLOO_SOCKET_IFNAME")
        if ifname:
            device = dist.ProcessGroupGloo.create_device(interface=ifname)
        else:
            host = cfg.host if self.rank == 0 else local_address(cfg.host)
            device = dist.ProcessGroupGloo.create_device(hostname=host)
        opts._devices = [device]
        return dist.ProcessGroupGloo(store, self.rank, cfg.world_size, opts)

    def _tag(self, peer: int) -> int:
        """The tag of the next transfer between this rank and `peer` (their count so far)."""
        n = self._tags[peer] = self._tags.get(peer, 0) + 1
        return n % (1 << 30)

    def _post(self, tensor: torch.Tensor, src: int, to: Collection[int] | None) -> Handle:
        if self.rank != src:
            return _Works({src: self.pg.recv([tensor], src, self._tag(src))}, self._timeout,
                          self.lost)
        peers = range(self.world_size) if to is None else sorted(set(to))
        works, failed = {}, {}
        for r in peers:
            if r == src or r in self.lost:
                continue
            try:
                works[r] = self.pg.send([tensor], r, self._tag(r))
            except RuntimeError as e:  # its connection is gone: the others still get theirs
                failed[r] = e
        self.lost.update(failed)
        return _Works(works, self._timeout, self.lost, failed)

    def _abort_group(self, pg: Any) -> None:
        """Nothing to end: gloo's operations time out on their own."""
