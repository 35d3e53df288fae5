"""Several senders in one update: the coordinator's side (`coordinate`) and the others'
(`PeerSender`). One sender never comes here (`PushClient.push` runs alone).

Sender 0, the coordinator, runs the control plane with the receivers as one sender does; the
other senders reach it over the same ROUTER. Per update: each sender offers its tensors (`Offer`),
the coordinator gives each tensor one owner (`owners.plan_owners`), cuts each owner's tensors into
buckets of its own and interleaves them by bytes (`owners.plan_headers`); the `Plan` goes to the
receivers and the senders; every one of them answers `Ready` (a sender: its headers name tensors
it holds, as offered); one `Go` covers every bucket. Each sender then posts its buckets back to
back on its own data-plane group ({itself} + every receiver), so the senders' bytes move at the
same time on separate groups and links; on gloo each sends a `Digest` per bucket to the
coordinator, which relays it unchanged to the receivers, and a `Sent` (its checksums) after its
last one. The coordinator seals the update once every sender's `Sent` arrived, runs the commit
round, and tells the senders the verdict (`Commit` or `Abort`), so every trainer rank ends the
update the same way.

Failures: a sender that says nothing in time (no `Offer`, no `Ready`, no `Sent`) fails the
update on the coordinator with a `PushError` naming its rank, and every rank gets `Abort`; a
receiver whose collective from a dead sender times out reports the sender by rank. Once a sender
is lost, the groups are given up: every rank must join again (a new `PushClient`/`Receiver`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from vllm_nccl_sync.outcomes import PeerFailed
from vllm_nccl_sync.planes.base import Handle, Transport
from vllm_nccl_sync.trainer.owners import OwnershipError, plan_headers, plan_owners
from vllm_nccl_sync.trainer.push import (
    PushClient,
    PushError,
    PushResult,
    UpdateRefused,
    _without_aliases,
    as_push_error,
)
from vllm_nccl_sync.wire.channel import ReceiverChannel, clip
from vllm_nccl_sync.wire.config import SyncConfig
from vllm_nccl_sync.wire.integrity import checksum, checksum_gpu
from vllm_nccl_sync.wire.packing import (
    Bucket,
    alone_bytes,
    as_bytes,
    dtype_name,
    pack,
    tensor_nbytes,
)
from vllm_nccl_sync.wire.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Abort,
    BucketHeader,
    Commit,
    Digest,
    Error,
    Go,
    Offer,
    Plan,
    Ready,
    Seal,
    SenderHello,
    Sent,
    TensorSpec,
    encode,
)

log = logging.getLogger(__name__)

_POLL_S = 0.005
"""How long the coordinator's relay holds the control socket per look while collectives run."""


def _items(named_tensors: Mapping[str, torch.Tensor] | Iterable,
           dtype: torch.dtype | None) -> list[tuple[str, torch.Tensor]]:
    if not isinstance(named_tensors, Mapping):
        raise TypeError("several senders take a mapping (a state dict) of each rank's tensors, "
                        "not a stream")
    return [(n, t.to(dtype) if dtype and t.is_floating_point() else t)
            for n, t in _without_aliases(named_tensors)]


def _specs(items: list[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    return [TensorSpec(n, dtype_name(t.dtype), list(t.shape)) for n, t in items]


class _Lane:
    """One sender's own buckets on its own group: double-buffered, checksummed per bucket."""

    def __init__(self, transport: Transport, buffers: list[torch.Tensor], check: bool) -> None:
        self.transport = transport
        self.buffers = buffers
        self.check = check
        self.gpu = transport.device.type == "cuda"
        self.works: list[Handle | None] = [None, None]
        self.lost: list[PeerFailed] = []
        self.sums: dict[int, Any] = {}
        self.bytes = self.tensors = self.posted = 0
        self.failure: BaseException | None = None

    def _free(self, i: int) -> torch.Tensor:
        work, self.works[i] = self.works[i], None
        if work is not None:
            try:
                work.wait()  # gloo: bounded by the group's timeout
            except PeerFailed as e:  # the others got their bytes; go on without that receiver
                self.lost.append(e)
        return self.buffers[i]

    def send(self, h: BucketHeader, by_name: dict[str, torch.Tensor], timeout_s: float) -> int:
        """Post bucket `h` (always: a `Go` covers it); returns its checksum (0: none, or a GPU
        tensor)."""
        i = self.posted % 2
        buf = self._free(i)
        self.posted += 1
        try:
            sources = [by_name[s.name] for s in h.slots]
            if len(h.slots) == 1 and sources[0].device == self.transport.device:
                s = h.slots[0]  # zero copy: the collective reads the tensor's own memory
                wire = as_bytes(sources[0])[s.start : s.start + s.nbytes]
            else:
                wire = pack(Bucket(list(h.slots), sources), buf)
        except Exception as e:  # noqa: BLE001 - agreed: the collective still runs
            self.failure = self.failure or e
            wire = buf[: h.length]
        if h.length:
            try:
                self.works[i] = self.transport.broadcast(wire)
            except RuntimeError as e:  # gloo: a receiver's connection is gone already
                self.lost.append(PeerFailed(f"broadcast of bucket {h.seq} failed: {e}", -1))
        digest: Any = 0
        if self.check and h.length:
            digest = checksum_gpu(wire) if self.gpu else checksum(wire)
        self.sums[h.seq] = digest
        self.transport.extend(timeout_s)
        self.bytes += h.length
        self.tensors += sum(s.start + s.nbytes == tensor_nbytes(s.dtype, s.shape)
                            for s in h.slots)
        return digest

    def drain(self, timeout_s: float) -> dict[int, int]:
        """Wait for the last collectives; every checksum as an int."""
        for i in range(2):
            self._free(i)
        if self.gpu:
            cur = torch.cuda.current_stream(self.transport.device)
            self.transport.wait_stream(cur, timeout_s)
        return {k: int(v) for k, v in self.sums.items()}


def _buffers(cfg: SyncConfig, transport: Transport) -> list[torch.Tensor]:
    return [torch.empty(cfg.bucket_bytes, dtype=torch.uint8, device=transport.device)
            for _ in range(2)]


def coordinate(client: PushClient, named_tensors: Mapping[str, torch.Tensor], version: int, *,
               dtype: torch.dtype | None = None, force: bool = False, full: bool = False,
               staged: bool = False, balance: bool = False, progress: Any = None) -> PushResult:
    """`PushClient.push` of sender 0 when there are several senders (see the module text)."""
    cfg, channel = client.cfg, client.channel
    if client.transport.broken:
        raise PushError(f"transfer group is broken ({client.transport.broken}); every sender "
                        "and receiver must join again (new PushClient / Receiver)")
    check = cfg.bucket_checksums is not False
    strict = sorted(r for r, h in client.hellos.items() if h.checksums)
    if strict and not check:
        raise PushError(f"ranks {strict} require bucket checksums; this client has "
                        "bucket_checksums=False")
    items = _items(named_tensors, dtype)
    peers = sorted(client.peers)
    everyone = client.ranks + peers
    offers = {0: (_specs(items), not balance)}
    done: dict[int, Sent] = {}
    errors: dict[int, str] = {}
    lane = _Lane(client.transport, client._buffers, check)
    client._lost = lane.lost
    total = 0
    t0 = time.perf_counter()

    def relay(deadline: float) -> None:
        """Take one message (until `deadline`): relay a sender's `Digest`, keep `Sent`s and
        `Error`s of this update."""
        try:
            rank, msg = channel.recv(deadline)
        except TimeoutError:
            return
        if getattr(msg, "version", version) not in (version, -1) or rank not in everyone:
            log.info("ignoring %s from rank %d during update %d", type(msg).__name__, rank,
                     version)
        elif isinstance(msg, Error):
            errors[rank] = clip(msg.message)
        elif rank in peers and isinstance(msg, Digest):
            client._tell(msg)  # unchanged: each receiver checks it before loading the bucket
        elif rank in peers and isinstance(msg, Sent):
            done[rank] = msg
        else:
            log.warning("ignoring %s from rank %d mid-update", type(msg).__name__, rank)

    try:
        offers.update(_offers(client, version, peers))
        try:
            owner = plan_owners(offers)
        except OwnershipError as e:
            raise PushError(f"update {version} refused: {e}") from None
        order = {r: [t for t in specs if owner[t.name] == r] for r, (specs, _) in offers.items()}
        tensors = list({t.name: t for specs, _ in offers.values() for t in specs}.values())
        headers = plan_headers(order, cfg.bucket_bytes, version, PROTOCOL_VERSION, force, staged,
                               alone_bytes(cfg.bucket_bytes, cfg.backend))
        total = len(headers)
        plan = Plan(PROTOCOL_VERSION, version, tensors, full, force, None, headers, staged)
        if len(encode(plan)) > MAX_FRAME_BYTES:
            raise PushError(f"update {version}: its plan ({len(headers)} buckets) exceeds one "
                            f"control frame; raise bucket_bytes")
    except PushError as e:
        client._abort_all(version, -1, str(e))
        raise
    try:
        client._send_all(plan)
        lost = channel.send_all(peers, plan)
        if lost:
            raise PushError(f"senders {lost} cannot be reached (gone?) sending Plan",
                            missing=lost)
        client._gather(Ready, total - 1, version, ranks=everyone)
    except PushError as e:
        client._abort_all(version, total - 1, str(e))
        raise UpdateRefused(str(e), e.errors, e.missing) from None
    by_name = dict(items)
    # While this sender's collectives run (a gloo send completes only once every receiver took
    # it, and they take bucket k only after the Digest of every bucket before it), a thread
    # relays the other senders' Digests; the control socket is used under `lock` only.
    lock, stop = threading.Lock(), threading.Event()

    def relay_loop() -> None:
        while not stop.is_set():
            with lock:
                relay(time.monotonic() + _POLL_S)
            time.sleep(_POLL_S / 10)  # let the pushing thread take the lock

    relayer = threading.Thread(target=relay_loop, name="nccl-sync-relay", daemon=True)
    try:
        with client.transport.armed(cfg.timeout_s, f"update {version}"):
            go = Go(PROTOCOL_VERSION, version, total - 1)
            client._tell(go)
            for r in channel.send_all(peers, go):
                errors[r] = "cannot be reached (gone?) sending Go"
            t0 = time.perf_counter()
            relayer.start()
            try:
                for h in headers:
                    if h.src != 0:
                        continue
                    digest = lane.send(h, by_name, cfg.timeout_s)
                    if not lane.gpu and h.length:
                        with lock:
                            client._tell(Digest(PROTOCOL_VERSION, version, h.seq, digest))
                    if progress:
                        progress(lane.posted, lane.bytes, time.perf_counter() - t0)
                sums = lane.drain(cfg.timeout_s)
            finally:
                stop.set()
                relayer.join()
            client.transport.extend(2 * cfg.timeout_s)
            end = time.monotonic() + cfg.timeout_s  # every other sender's Sent
            while len(done) < len(peers) and not errors and time.monotonic() < end:
                relay(end)
            silent = [r for r in peers if r not in done and r not in errors]
            if lane.failure is not None:  # the tensor source failed
                raise lane.failure
            problems = [f"rank {r}: {m}" for r, m in sorted(errors.items())]
            if silent and errors:  # the wait for their `Sent` ended with the errors
                problems.append(f"senders {silent} did not finish their buckets (dead?)")
            elif silent:
                problems.append(f"senders {silent} sent nothing within {cfg.timeout_s:.1f} s "
                                f"after the coordinator's last bucket (dead?)")
            left = sorted({e.rank + cfg.num_senders - 1 for e in lane.lost if e.rank >= 0})
            if left:
                problems.append(f"receivers {left} left sender 0's data plane")
            problems += [clip(str(e), 300) for e in lane.lost[:1] if e.rank < 0]
            if problems:
                raise PushError(f"update {version} failed: " + "; ".join(problems), errors,
                                silent + left)
            for r, s in done.items():
                sums.update(s.checksums)
                want = {h.seq for h in headers if h.src == r}
                if set(s.checksums) != want:
                    raise PushError(f"update {version}: sender {r} reported buckets "
                                    f"{sorted(s.checksums)[:8]}, its plan has {sorted(want)[:8]}")
            client._send_all(Seal(PROTOCOL_VERSION, version, total,
                                  [sums.get(k, 0) for k in range(total)]))
            acks = client._commit_round(version, total, 1)
            channel.send_all(peers, Commit(PROTOCOL_VERSION, version, 1))
            if staged:
                client._commit_round(version, total, 2)
                channel.send_all(peers, Commit(PROTOCOL_VERSION, version, 2))
    except Exception as e:  # a receiver, a sender or the tensor source failed: end every wait
        client._abort_all(version, total, str(e))
        # Past the Go, a failure may have left any sender's group out of step (or its sender
        # gone): every rank gives its groups up and joins again.
        client.transport.abort(f"update {version} failed: {clip(str(e), 300)}")
        err = as_push_error(e, f"update {version} failed", "the coordinator")
        if err is e:
            raise
        raise err from e
    per_sender = {0: lane.bytes}
    for h in headers:
        if h.src:
            per_sender[h.src] = per_sender.get(h.src, 0) + h.length
    return PushResult(version, lane.posted, lane.bytes, lane.tensors,
                      time.perf_counter() - t0, list(acks.values()), per_sender)


def _offers(client: PushClient, version: int, peers: list[int]) -> dict[int, tuple]:
    """Every other sender's `Offer` of update `version` (bounded by `timeout_s`)."""
    got: dict[int, tuple] = {}
    deadline = time.monotonic() + client.cfg.timeout_s
    while len(got) < len(peers):
        try:
            rank, msg = (client.early.pop(0) if client.early
                         else client.channel.recv(deadline))
        except TimeoutError:
            silent = [r for r in peers if r not in got]
            raise PushError(f"update {version}: senders {silent} offered nothing within "
                            f"{client.cfg.timeout_s:.1f} s (dead, or not pushing?)",
                            missing=silent) from None
        if rank in peers and isinstance(msg, Offer) and msg.version == version:
            got[rank] = (msg.tensors, msg.owned)
        elif rank in peers and isinstance(msg, Error) and msg.version == version:
            raise PushError(f"update {version}: sender {rank}: {clip(msg.message)}",
                            {rank: clip(msg.message)})
        else:
            log.info("ignoring %s from rank %d before update %d", type(msg).__name__, rank,
                     version)
    return got


class PeerSender:
    """Sender `rank` > 0: joins the coordinator's control socket, hosts its own data-plane group,
    and pushes the buckets the coordinator's plan gives it (`PushClient(cfg, rank=...)`)."""

    def __init__(self, cfg: SyncConfig, rank: int, device: torch.device | None = None) -> None:
        self.cfg = cfg
        self.rank = rank
        self.device = device
        self.channel = ReceiverChannel(cfg.host, cfg.control_port, rank, cfg.secret_bytes)
        self.transport: Transport | None = None
        self._buffers: list[torch.Tensor] = []
        # The coordinator may wait `timeout_s` for the other senders and as long for the
        # receivers before its verdict: wait for it a little longer than both.
        self._verdict_s = 2 * cfg.timeout_s + max(1.0, 0.1 * cfg.timeout_s)

    def connect(self) -> dict:
        """Join the coordinator, then host this sender's group until every receiver joined it."""
        self.channel.send(SenderHello(PROTOCOL_VERSION, self.rank, self.cfg.bucket_bytes,
                                      self.cfg.backend), self.cfg.timeout_s)
        self.transport = Transport(self.cfg.group(self.rank), 0, self.device)
        self._buffers = _buffers(self.cfg, self.transport)
        return {}

    def _expect(self, kind: type, version: int, what: str, phase: int | None = None):
        """The coordinator's next `kind` of update `version` (its `Abort` raises `PushError`)."""
        deadline = time.monotonic() + self._verdict_s
        while True:
            try:
                msg = self.channel.recv(max(deadline - time.monotonic(), 0.0), fail_on_drop=True)
            except (TimeoutError, ConnectionError) as e:
                raise PushError(f"update {version}: the coordinator (sender 0) said nothing "
                                f"within {self._verdict_s:.1f} s while sender {self.rank} "
                                f"waited for {what} (coordinator dead?): {e}") from None
            if getattr(msg, "version", version) != version:
                continue
            if isinstance(msg, Abort):
                raise PushError(f"update {version} aborted by the coordinator: "
                                f"{clip(msg.reason)}")
            if isinstance(msg, kind) and getattr(msg, "phase", phase) == phase:
                return msg
            log.warning("sender %d ignoring %s while waiting for %s", self.rank,
                        type(msg).__name__, what)

    def _refuse(self, version: int, problem: str) -> None:
        try:
            self.channel.send(Error(PROTOCOL_VERSION, self.rank, -1, clip(problem), " ",
                                    version), min(self.cfg.timeout_s, 5.0))
        except (TimeoutError, OSError) as e:
            log.warning("sender %d could not report its error: %s", self.rank, e)

    def push(self, named_tensors: Mapping[str, torch.Tensor], version: int, *,
             dtype: torch.dtype | None = None, force: bool = False, full: bool = False,
             staged: bool = False, balance: bool = False) -> PushResult:
        """Offer these tensors for update `version` and send the buckets the plan gives this
        sender; returns once the coordinator committed the update (`PushError` otherwise)."""
        if self.transport is None:
            raise RuntimeError("call connect() before push()")
        if self.transport.broken:
            raise PushError(f"transfer group is broken ({self.transport.broken}); every sender "
                            "and receiver must join again (new PushClient / Receiver)")
        items = _items(named_tensors, dtype)
        by_name = dict(items)
        self.channel.send(Offer(PROTOCOL_VERSION, self.rank, version, _specs(items),
                                not balance), self.cfg.timeout_s)
        plan = self._expect(Plan, version, "the Plan")
        mine = [h for h in plan.buckets if h.src == self.rank]
        have = {t.name: t for t in _specs(items)}
        bad = sorted({s.name for h in mine for s in h.slots
                      if have.get(s.name) != TensorSpec(s.name, s.dtype, s.shape)})
        problem = ""
        if bad:
            problem = f"sender {self.rank} holds no such tensor(s) as the plan gives it: {bad[:5]}"
        elif (plan.force, plan.staged, plan.full) != (force, staged, full):
            problem = (f"sender {self.rank} pushes force={force} staged={staged} full={full}, "
                       f"the coordinator {plan.force} {plan.staged} {plan.full}")
        if problem:
            self._refuse(version, problem)
            self._expect(Abort, version, "the Abort of a refused plan")  # raises PushError
        last = plan.buckets[-1].seq
        self.channel.send(Ready(PROTOCOL_VERSION, self.rank, last, version), self.cfg.timeout_s)
        lane = _Lane(self.transport, self._buffers, self.cfg.bucket_checksums is not False)
        try:
            with self.transport.armed(self._verdict_s, f"update {version}"):
                go = self._expect(Go, version, "Go")
                if go.seq < last:
                    raise PushError(f"update {version}: Go covers bucket {go.seq}, not all "
                                    f"{last + 1}")
                t0 = time.perf_counter()
                for h in mine:
                    digest = lane.send(h, by_name, self.cfg.timeout_s)
                    if not lane.gpu and h.length:
                        self.channel.send(Digest(PROTOCOL_VERSION, version, h.seq, digest),
                                          self.cfg.timeout_s)
                sums = lane.drain(self.cfg.timeout_s)
                failure = lane.failure or (lane.lost[0] if lane.lost else None)
                if failure is not None:  # tell the coordinator; its verdict says why
                    text = f"sender {self.rank}: {clip(str(failure), 500)}"
                    self._refuse(version, text)
                    try:
                        self._expect(Abort, version, "the verdict")
                    except PushError as e:
                        raise PushError(f"{e}; {text}") from None
                self.channel.send(Sent(PROTOCOL_VERSION, self.rank, version, sums),
                                  self.cfg.timeout_s)
                self.transport.extend(self._verdict_s)
                self._expect(Commit, version, "Commit", 1)
                if staged:
                    self._expect(Commit, version, "Commit(2)", 2)
        except Exception as e:  # past the Go: every rank gives its groups up (see coordinate)
            self.transport.abort(f"update {version} failed: {clip(str(e), 300)}")
            if isinstance(e, PushError):
                raise
            raise PushError(f"update {version} failed on sender {self.rank}: "
                            f"{clip(repr(e))}") from e
        return PushResult(version, lane.posted, lane.bytes, lane.tensors,
                          time.perf_counter() - t0, [])

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.channel.close()
