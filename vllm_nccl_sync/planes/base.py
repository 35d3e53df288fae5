"""Data plane: one broadcast collective per bucket, from rank 0 (the trainer) to every receiver.

Each transport is its own process group built from its own rendezvous (a `TCPStore` hosted by
rank 0), so it never touches the default process group that vLLM (or the trainer) already uses.
Backends are chosen by name: `gloo` (CPU tensors) and `nccl` (CUDA tensors).

Failure isolation. A collective whose peer died never completes. On NCCL such a collective must
not be left to torch's watchdog, whose default error handling ends the whole process a minute
after the group's timeout. So the NCCL group is built with the watchdog's error handling off and a
group timeout far past this package's own, and the transport carries a deadman: while an update is
`armed`, a thread aborts the communicator (`ncclCommAbort`, which makes the stuck kernels exit) the
moment the deadline passes, whatever the caller's thread is blocked in. An aborted group is
`broken` for good; the next join builds a new one. Gloo collectives time out on their own
(`timeout_s`). On gloo the trainer sends each receiver its bytes point to point, so a receiver can
post its whole buffer: a sender that sends more than it announced is caught (the bytes past
`length` change) instead of making gloo abort the process; and a receiver that died does not stop
the others from getting every bucket they agreed to (later sends skip it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from vllm_nccl_sync.outcomes import PeerFailed
from vllm_nccl_sync.wire.config import SyncConfig

log = logging.getLogger(__name__)

_NCCL_GROUP_TIMEOUT_FACTOR = 4
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


class _Works:
    """Gloo point-to-point operations, one per peer, as one handle; `wait` is bounded.

    A failed peer does not hold up the others: every operation is waited for, the failed peers
    are added to `lost` (the transport's, so later broadcasts skip them), and the first failure
    is raised."""

    def __init__(self, works: dict[int, Any], timeout: timedelta, lost: set[int]) -> None:
        self._works = works
        self._timeout = timeout
        self._lost = lost

    def wait(self) -> bool:
        failed: list[tuple[int, RuntimeError]] = []
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


class Transport:
    """A broadcast-only process group made without the default group.

    `broadcast` returns at once; the caller waits on the handle. With NCCL, `wait()` only orders
    the current CUDA stream after the collective (the host does not block), which is what lets
    packing and loading overlap with the transfer.
    """

    digest_per_bucket: bool
    """True (gloo): the sender sends each bucket's checksum in a `Digest` right after posting it,
    and a receiver checks it before loading the bucket. False (NCCL): both sides checksum on the
    device beside the collective and compare once, at the `Seal`."""
    canary_bytes: int
    """Bytes past `length` a receiver posts and fills with random bytes (gloo: a longer send is
    then caught instead of aborting the process); 0: it posts exactly `length` bytes."""

    def __init__(self, cfg: SyncConfig, rank: int, device: torch.device | None = None) -> None:
        if not 0 <= rank < cfg.world_size:
            raise ValueError(f"rank {rank} outside [0, {cfg.world_size})")
        self.backend = cfg.backend
        self.digest_per_bucket = cfg.backend == "gloo"
        self.canary_bytes = 8 if cfg.backend == "gloo" else 0
        self.rank = rank
        self.world_size = cfg.world_size
        self.pg = None
        self.broken = ""
        """Why this group can no longer be used ("" while healthy); a new join rebuilds it."""
        self._deadline: float | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._what = ""
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
        self.lost: set[int] = set()
        """Gloo: peers whose transfer failed (gone); later broadcasts from here skip them."""
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
            self._timeout = timedelta(
                seconds=cfg.timeout_s * _NCCL_GROUP_TIMEOUT_FACTOR + 60)
            nccl_opts._timeout = self._timeout
            # The collectives become runnable exactly when the previous bucket's pack/load copies
            # do; at equal priority those copies' blocks fill the GPU first and the link idles.
            nccl_opts.is_high_priority_stream = True
            # 0 = no async error handling: a failed collective never tears the process down; the
            # deadman below aborts the communicator instead. No heartbeat monitor for this group.
            with _env(TORCH_NCCL_ASYNC_ERROR_HANDLING="0", TORCH_NCCL_ENABLE_MONITORING="0",
                      TORCH_NCCL_PROPAGATE_ERROR="0"):
                self.pg = dist.ProcessGroupNCCL(store, rank, cfg.world_size, nccl_opts)
            self._deadman = threading.Thread(target=self._watch, name="nccl-sync-deadman",
                                             daemon=True)
            self._deadman.start()
            # Build the communicator now, inside the rendezvous timeout, not in the first bucket.
            with self.armed(cfg.timeout_s, "building the NCCL communicator"), \
                    torch.cuda.device(self.device):
                self.broadcast(torch.zeros(1, dtype=torch.uint8, device=self.device)).wait()
                self.wait_stream(torch.cuda.current_stream(), cfg.timeout_s)
            self.bytes_moved = 0  # the warm-up above is not part of any update
            self.collectives = 0

    def _watch(self) -> None:
        """Deadman thread (NCCL): abort the communicator once an armed deadline has passed."""
        while True:
            with self._cond:
                if self._closed:
                    return
                if self._deadline is None:
                    self._cond.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                what, self._deadline = self._what, None
            self.abort(f"{what} did not finish within the deadline")

    @contextlib.contextmanager
    def armed(self, seconds: float, what: str) -> Iterator[None]:
        """Abort the group if the block (and the collectives it posted) is not done in `seconds`.

        On NCCL the abort comes from another thread, so it also ends a host wait the caller is
        stuck in (a stream sync behind a collective that will never complete). On gloo each
        collective has its own timeout and this only records the deadline.
        """
        with self._cond:
            self._deadline, self._what = time.monotonic() + seconds, what
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                self._deadline = None

    def extend(self, seconds: float) -> None:
        """Push an armed deadline to `seconds` from now (a new phase of the same update)."""
        with self._cond:
            if self._deadline is not None:
                self._deadline = time.monotonic() + seconds
                self._cond.notify()

    def wait_stream(self, stream: torch.cuda.Stream, timeout_s: float) -> None:
        """Wait for everything queued on `stream` so far, polling: never an unbounded host sync.

        Raises `TimeoutError` after `timeout_s` (the group is then aborted) or `RuntimeError` if
        the group was aborted meanwhile.
        """
        ev = torch.cuda.Event()
        ev.record(stream)
        deadline = time.monotonic() + timeout_s
        delay = 1e-5
        while not ev.query():
            if self.broken:
                raise RuntimeError(f"transfer group aborted: {self.broken}")
            if time.monotonic() > deadline:
                self.abort(f"GPU work did not finish within {timeout_s:.1f} s")
                ev.synchronize()  # the abort made the stuck kernels exit
                raise TimeoutError(f"GPU work did not finish within {timeout_s:.1f} s; "
                                   "transfer group aborted")
            time.sleep(delay)
            delay = min(delay * 2, 2e-4)
        if self.broken:
            raise RuntimeError(f"transfer group aborted: {self.broken}")

    def abort(self, reason: str) -> None:
        """Give the group up: on NCCL abort the communicator (pending collectives end at once).

        Idempotent and safe from any thread; the transport is `broken` afterwards.
        """
        first = not self.broken
        self.broken = self.broken or reason
        pg = self.pg
        if not first or pg is None:
            return
        log.warning("aborting the %s transfer group (rank %d): %s", self.backend, self.rank, reason)
        if self.backend == "nccl":
            try:
                pg.abort()
            except Exception:  # noqa: BLE001 - the group is given up either way
                log.exception("aborting the NCCL communicator failed")

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, length: int | None = None) -> Handle:
        """Start broadcasting `tensor` (uint8) from rank `src` to every other rank.

        NCCL: one broadcast collective. Gloo: one point-to-point send from `src` to each rank
        (gloo's broadcast relays through a tree, and a relay forwards whatever size it posted);
        a receiver may post more room than announced and gets exactly what was sent.
        `length`: the bytes announced (by default all of `tensor`), for the byte counters.
        Every rank must wait on every handle it gets (on gloo a point-to-point operation that is
        never waited for leaves the peers out of step until the group's timeout).
        """
        if self.broken:
            raise RuntimeError(f"transfer group is broken ({self.broken}); join again")
        if tensor.dtype != torch.uint8 or tensor.device != self.device:
            raise ValueError(
                f"broadcast takes uint8 on {self.device}, got {tensor.dtype} on {tensor.device}"
            )
        self.bytes_moved += tensor.numel() if length is None else length
        self.collectives += 1
        if self.backend == "gloo":
            tag = self.collectives % (1 << 30)
            if self.rank != src:
                return _Works({src: self.pg.recv([tensor], src, tag)}, self._timeout, self.lost)
            return _Works({r: self.pg.send([tensor], r, tag) for r in range(self.world_size)
                           if r != src and r not in self.lost}, self._timeout, self.lost)
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        opts.timeout = self._timeout
        return self.pg.broadcast([tensor], opts)

    def close(self) -> None:
        """Drop the group (a broken one included: the next join builds a new one)."""
        with self._cond:
            self._closed = True
            self._deadline = None
            self._cond.notify()
        if self.pg is not None and self.backend == "nccl" and not self.broken:
            self.broken = "closed"
            try:
                self.pg.abort()  # no collective is pending on a healthy group: just frees it
            except Exception:  # noqa: BLE001
                log.exception("freeing the NCCL communicator failed")
        self.pg = None
        self._store = None
