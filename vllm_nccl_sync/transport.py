"""Data plane: one broadcast collective per bucket, from rank 0 (the trainer) to every receiver.

Each transport is its own process group built from its own rendezvous (a `TCPStore` hosted by
rank 0), so it never touches the default process group that vLLM (or the trainer) already uses.
Backends are chosen by name: `gloo` (CPU tensors) and `nccl` (CUDA tensors).
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from .config import SyncConfig


class Handle(Protocol):
    """A collective in flight."""

    def wait(self) -> bool: ...


def local_address(peer: str) -> str:
    """The address of this host that the kernel routes to `peer` from (no packet is sent)."""
    family, _, _, _, addr = socket.getaddrinfo(peer, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return s.getsockname()[0]


def await_listener(host: str, port: int, timeout_s: float) -> None:
    """Return once `host:port` accepts a TCP connection; `TimeoutError` naming it after `timeout_s`.

    A `TCPStore` client retries on its own and can take about twice its timeout to give up, with
    a message that does not say what to check; this wait is bounded and says it.
    """
    deadline = time.monotonic() + timeout_s
    delay, last = 0.05, None
    while (left := deadline - time.monotonic()) > 0:
        try:
            with socket.create_connection((host, port), timeout=min(left, 5.0)):
                return
        except OSError as e:
            last = e
        time.sleep(max(min(delay, deadline - time.monotonic()), 0))
        delay = min(delay * 2, 0.5)
    raise TimeoutError(
        f"the trainer's rendezvous (TCPStore) at {host}:{port} accepted no connection within "
        f"{timeout_s:.1f} s (last error: {last}); is the trainer up, and is SyncConfig.host an "
        f"address of it that this host can reach?"
    )


class Transport:
    """A broadcast-only process group made without the default group.

    `broadcast` returns at once; the caller waits on the handle. With NCCL, `wait()` only orders
    the current CUDA stream after the collective (the host does not block), which is what lets
    packing and loading overlap with the transfer.
    """

    def __init__(self, cfg: SyncConfig, rank: int, device: torch.device | None = None) -> None:
        if not 0 <= rank < cfg.world_size:
            raise ValueError(f"rank {rank} outside [0, {cfg.world_size})")
        self.backend = cfg.backend
        self.rank = rank
        if cfg.backend == "nccl":
            self.device = device or torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self._timeout = timedelta(seconds=cfg.timeout_s)
        if rank != 0:
            await_listener(cfg.host, cfg.group_port, cfg.timeout_s)
        listen_fd = None
        if rank == 0:  # bind the configured address only (TCPStore alone binds every interface)
            family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
            listener = socket.socket(family, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((cfg.host, cfg.group_port))
            listener.listen(max(cfg.world_size, 16))
            listen_fd = listener.detach()  # the store owns and closes it
        self._store = dist.TCPStore(
            cfg.host,
            cfg.group_port,
            cfg.world_size,
            is_master=rank == 0,
            timeout=self._timeout,
            wait_for_workers=False,
            master_listen_fd=listen_fd,
        )
        store = dist.PrefixStore("vllm_nccl_sync", self._store)
        self.bytes_moved = 0
        self.collectives = 0
        if cfg.backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = self._timeout
            # Each rank binds an address of its own host: the trainer its configured one, a
            # receiver the one that routes to the trainer (GLOO_SOCKET_IFNAME overrides both).
            ifname = os.environ.get("GLOO_SOCKET_IFNAME")
            if ifname:
                device = dist.ProcessGroupGloo.create_device(interface=ifname)
            else:
                host = cfg.host if rank == 0 else local_address(cfg.host)
                device = dist.ProcessGroupGloo.create_device(hostname=host)
            opts._devices = [device]
            self.pg = dist.ProcessGroupGloo(store, rank, cfg.world_size, opts)
        else:
            nccl_opts = dist.ProcessGroupNCCL.Options()
            nccl_opts._timeout = self._timeout
            # The collectives become runnable exactly when the previous bucket's pack/load copies
            # do; at equal priority those copies' blocks fill the GPU first and the link idles.
            nccl_opts.is_high_priority_stream = True
            self.pg = dist.ProcessGroupNCCL(store, rank, cfg.world_size, nccl_opts)
            # Build the communicator now, inside the rendezvous timeout, not in the first bucket.
            with torch.cuda.device(self.device):
                self.broadcast(torch.zeros(1, dtype=torch.uint8, device=self.device)).wait()
                torch.cuda.current_stream().synchronize()
            self.bytes_moved = 0  # the warm-up above is not part of any update
            self.collectives = 0

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> Handle:
        """Start broadcasting `tensor` (uint8: exactly the bytes to move) from rank `src`."""
        if tensor.dtype != torch.uint8 or tensor.device != self.device:
            raise ValueError(
                f"broadcast takes uint8 on {self.device}, got {tensor.dtype} on {tensor.device}"
            )
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        opts.timeout = self._timeout
        self.bytes_moved += tensor.numel()
        self.collectives += 1
        return self.pg.broadcast([tensor], opts)

    def close(self) -> None:
        """Drop the group; a broken group (peer died, timeout) must be closed and rebuilt."""
        if self.pg is not None and self.backend == "nccl":
            try:
                self.pg.abort()
            except (AttributeError, RuntimeError):
                pass
        self.pg = None
        self._store = None
