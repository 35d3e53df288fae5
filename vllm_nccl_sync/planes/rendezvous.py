"""How the ranks of a data-plane group find each other: a `TCPStore` that rank 0 hosts on the
configured address only (`open_store`), reached within a bound that says what to check
(`await_listener`), and the address of this host that routes to the trainer (`local_address`).

Each plane's group is built on its own store, so it never touches the default process group that
vLLM (or the trainer) already uses.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import torch.distributed as dist

from vllm_nccl_sync.wire.config import SyncConfig


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


def open_store(cfg: SyncConfig, rank: int) -> dist.TCPStore:
    """The group's rendezvous: rank 0 hosts a `TCPStore` bound to `cfg.host` only (TCPStore
    alone binds every interface); other ranks wait for it (`await_listener`), then join."""
    if rank != 0:
        await_listener(cfg.host, cfg.group_port, cfg.timeout_s)
    listen_fd = None
    if rank == 0:
        family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((cfg.host, cfg.group_port))
        listener.listen(max(cfg.world_size, 16))
        listen_fd = listener.detach()  # the store owns and closes it
    return dist.TCPStore(cfg.host, cfg.group_port, cfg.world_size, is_master=rank == 0,
                         timeout=timedelta(seconds=cfg.timeout_s), wait_for_workers=False,
                         master_listen_fd=listen_fd)
