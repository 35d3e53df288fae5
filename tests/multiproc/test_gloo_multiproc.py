"""Multi-process: a sender and two receivers over real ZeroMQ sockets and a real gloo group."""

from __future__ import annotations

import hashlib

import pytest
import torch

from tests.conftest import free_port
from tests.procs import record_broadcasts, run_procs
from vllm_nccl_sync import PushClient, SyncConfig
from vllm_nccl_sync.engine.receiver import Receiver
from vllm_nccl_sync.wire.packing import ALIGN

pytestmark = pytest.mark.multiproc
DEADLINE = 120


def model_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(300, 64, generator=g).to(torch.bfloat16),  # 38 KB > bucket
        "layers.0.qkv.weight": torch.randn(96, 32, generator=g).to(torch.float16),
        "layers.0.norm.weight": torch.randn(33, generator=g),
        "layers.0.steps": torch.randint(0, 2**40, (3,), generator=g),
        "layers.0.empty": torch.empty(0),
        "layers.1.mlp.weight": torch.randn(64, 48, generator=g).to(torch.bfloat16),
        "head.bias": torch.randn(7, generator=g).double(),
    }


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


class DigestLoader:
    """Keeps a digest of every tensor it is given (and nothing that references the buffer)."""

    def __init__(self):
        self.digests: dict[str, tuple[str, str, list[int]]] = {}

    def begin(self):
        pass

    def load(self, named):
        for n, t in named:
            self.digests[n] = (digest(t), str(t.dtype), list(t.shape))
        return {n for n, _ in named}

    def finish(self):
        pass

    def abort(self):
        pass


def sender_proc(cfg: dict, versions: list[int]) -> dict:
    sizes = record_broadcasts()
    client = PushClient(SyncConfig(**cfg))
    client.connect()
    results = []
    for v in versions:
        r = client.push(model_tensors(seed=v), version=v)
        results.append({"buckets": r.buckets, "bytes": r.bytes, "tensors": r.tensors,
                        "acks": sorted(a.rank for a in r.acks)})
    client.close()
    return {"results": results, "sizes": sizes}


def receiver_proc(cfg: dict, rank: int, n_updates: int) -> dict:
    sizes = record_broadcasts()
    rx = Receiver(SyncConfig(**cfg), rank)
    out = []
    for _ in range(n_updates):
        loader = DigestLoader()
        summary = rx.receive(loader, timeout_s=60)
        out.append({"summary": summary, "digests": loader.digests})
    rx.close()
    return {"updates": out, "sizes": sizes}


def make_cfg(bucket_bytes: int = 16 * 1024, backend: str = "gloo", **kw) -> dict:
    return dict(control_port=free_port(), group_port=free_port(), world_size=3,
                bucket_bytes=bucket_bytes, timeout_s=30.0, backend=backend, **kw)


@pytest.mark.parametrize("backend, receive_process", [("gloo", False), ("shm", False),
                                                      ("gloo", True)],
                         ids=["gloo", "shm", "gloo-receive-process"])
def test_two_receivers_get_bit_identical_tensors_and_exact_bytes(backend, receive_process):
    """Every receiver gets every tensor bit for bit, each broadcast exactly its bucket's bytes;
    also with each receiver's gloo group in a process of its own (`receive_process`)."""
    cfg = make_cfg(backend=backend, receive_process=receive_process)
    versions = [1, 2]
    sender, *receivers = run_procs(
        [(sender_proc, (cfg, versions))]
        + [(receiver_proc, (cfg, r, len(versions))) for r in (1, 2)],
        DEADLINE,
    )
    for i, v in enumerate(versions):
        want = {n: (digest(t), str(t.dtype), list(t.shape)) for n, t in model_tensors(v).items()}
        for rx in receivers:
            upd = rx["updates"][i]
            assert upd["summary"]["ok"], upd["summary"]
            assert upd["summary"]["version"] == v
            assert upd["digests"] == want
        assert sender["results"][i]["acks"] == [1, 2]
        assert sender["results"][i]["tensors"] == len(want)
    # Wire bytes: every broadcast carries its bucket's payload, never the buffer's capacity.
    payload = sum(t.numel() * t.element_size() for t in model_tensors(1).values())
    ntensors = len(model_tensors(1))
    per_update = sender["results"][0]["bytes"]
    assert payload <= per_update < payload + ALIGN * (ntensors + sender["results"][0]["buckets"])
    assert sum(sender["sizes"]) == sum(r["bytes"] for r in sender["results"])
    for rx in receivers:
        assert rx["sizes"] == sender["sizes"]
    assert max(sender["sizes"]) <= cfg["bucket_bytes"]
    assert sender["results"][0]["buckets"] >= 3  # the embedding alone spans several buckets


def test_exact_length_would_catch_a_full_buffer_sender():
    """The check above is not vacuous: a sender broadcasting whole buffers breaks it."""
    from vllm_nccl_sync.wire.packing import pack, plan_buckets

    buf = torch.zeros(1024, dtype=torch.uint8)
    b = next(plan_buckets([("x", torch.ones(10))], 1024))
    assert pack(b, buf).numel() == 40 != buf.numel()


# ---------------------------------------------------------------- agreement once per update

def _spy_control(client: PushClient) -> list[tuple]:
    """Record, in order, what the trainer sends (message kind and seq), receives (Ready) and
    broadcasts (bytes), from inside its process."""
    from vllm_nccl_sync.wire.protocol import BucketHeader, Go, Plan, Ready

    log: list[tuple] = []
    send_all, recv, broadcast = (client.channel.send_all, client.channel.recv,
                                 client.transport.broadcast)

    def spy_send_all(ranks, msg, *a, **kw):
        if isinstance(msg, Plan):
            log.append(("plan", [h.seq for h in msg.buckets]))
        elif isinstance(msg, (BucketHeader, Go)):
            log.append((type(msg).__name__, msg.seq))
        return send_all(ranks, msg, *a, **kw)

    def spy_recv(deadline):
        rank, msg = recv(deadline)
        if isinstance(msg, Ready):
            log.append(("Ready", rank, msg.seq))
        return rank, msg

    def spy_broadcast(tensor, *a, **kw):
        log.append(("broadcast", tensor.numel()))
        return broadcast(tensor, *a, **kw)

    client.channel.send_all, client.channel.recv = spy_send_all, spy_recv
    client.transport.broadcast = spy_broadcast
    return log


def stream_sender_proc(cfg: dict, window: int | None) -> dict:
    """One update as a generator announced `window` headers ahead (None: a mapping)."""
    client = PushClient(SyncConfig(**cfg))
    client.connect()
    log = _spy_control(client)
    tensors = model_tensors(seed=5)
    items = tensors if window is None else ((n, t) for n, t in tensors.items())
    r = client.push(items, version=5, window=window or 1)
    client.close()
    return {"log": log, "buckets": r.buckets}


@pytest.mark.parametrize("window", [None, 1, 2, 3], ids=["mapping", "w1", "w2", "w3"])
def test_agreement_comes_before_the_data_and_stays_ahead_of_it(window):
    """A mapping: one plan with every header, one Ready per receiver, one Go, then every
    collective back to back. A stream: the plan holds the first `window` headers, and each
    later header is announced (and its Go sent) `window` buckets ahead of its collective, so
    receivers never wait for one. Either way: no collective before a Go covering it, and the
    receivers get every tensor bit-exactly."""
    cfg = make_cfg(bucket_bytes=8 * 1024)
    sender, *receivers = run_procs(
        [(stream_sender_proc, (cfg, window))]
        + [(receiver_proc, (cfg, r, 1)) for r in (1, 2)], DEADLINE)
    want = {n: (digest(t), str(t.dtype), list(t.shape)) for n, t in model_tensors(5).items()}
    for rx in receivers:
        assert rx["updates"][0]["summary"]["ok"], rx["updates"][0]["summary"]
        assert rx["updates"][0]["digests"] == want
    log, n = sender["log"], sender["buckets"]
    assert n >= 6  # the embedding alone spans several buckets
    plan = [e for e in log if e[0] == "plan"]
    announced = list(plan[0][1]) if plan else []
    agreed, posted = -1, 0
    for e in log:
        if e[0] == "BucketHeader":
            announced.append(e[1])
        elif e[0] == "Go":
            assert e[1] <= max(announced), log  # a Go only covers announced headers
            agreed = max(agreed, e[1])
        elif e[0] == "broadcast" and e[1] > 1:  # (a 1-byte broadcast: the group's warm-up)
            assert posted <= agreed, (posted, log)  # never a collective before its Go
            ahead = n - 1 if window is None else min(posted + window - 1, n - 1)
            assert max(announced) >= ahead, (posted, announced, log)  # headers ran ahead
            posted += 1
    assert posted == n and announced == list(range(n)), log
    gos = [e for e in log if e[0] == "Go"]
    readies = [e for e in log if e[0] == "Ready"]
    if window is None:  # agreement once per update
        assert len(plan[0][1]) == n and len(gos) == 1 and len(readies) == 2, log
        assert not [e for e in log if e[0] == "BucketHeader"], log
    else:
        assert len(plan[0][1]) == window and len(gos) <= n - window + 1, log


class FailingLoader(DigestLoader):
    """Fails on its `fail_at`-th `load` call (a loader bug mid-update)."""

    def __init__(self, fail_at: int):
        super().__init__()
        self.calls, self.fail_at = 0, fail_at

    def load(self, named):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("loader exploded on purpose")
        return super().load(named)


def failing_receiver_proc(cfg: dict, rank: int, fail_at: int) -> dict:
    """Update 1 into a loader that fails mid-update; then update 2 into a good one."""
    sizes = record_broadcasts()
    rx = Receiver(SyncConfig(**cfg), rank)
    first = rx.receive(FailingLoader(fail_at), timeout_s=60)
    broken_after_first = rx.broken
    loader = DigestLoader()
    second = rx.receive(loader, timeout_s=60)
    rx.close()
    return {"first": first, "broken": broken_after_first, "second": second,
            "digests": loader.digests, "sizes": sizes}


def failing_update_sender_proc(cfg: dict) -> dict:
    from vllm_nccl_sync.trainer.push import PushError

    sizes = record_broadcasts()
    client = PushClient(SyncConfig(**cfg))
    client.connect()
    try:
        client.push(model_tensors(seed=1), version=1)
        first = {"raised": False}
    except PushError as e:
        first = {"raised": True, "message": str(e), "errors": e.errors, "missing": e.missing}
    r = client.push(model_tensors(seed=2), version=2)
    client.close()
    return {"first": first, "acks": sorted(a.rank for a in r.acks), "sizes": sizes}


def test_a_receiver_failing_mid_update_keeps_every_rank_in_step():
    """Every header was agreed in the plan; rank 1's loader then fails at its first load (in
    place, mid-update). It tells the trainer at once and keeps joining every agreed collective
    (its last bucket is the same as a complete update's); the trainer finishes them all, then
    aborts every rank. Rank 2 got, verified and loaded every bucket and
    reports itself inconsistent (not committed). Nobody's group broke: the next update reaches
    both, bit-exactly."""
    cfg = make_cfg()
    sender, failing, other = run_procs(
        [(failing_update_sender_proc, (cfg,)), (failing_receiver_proc, (cfg, 1, 1)),
         (receiver_proc, (cfg, 2, 2))], DEADLINE)
    first = sender["first"]
    assert first["raised"] and 1 in first["errors"], first
    assert "loader exploded on purpose" in first["errors"][1] and not first["missing"], first
    f1 = failing["first"]
    assert not f1["ok"] and "loader exploded on purpose" in f1["error"], f1
    assert not f1["consistent"] and f1["buckets"] == failing["second"]["buckets"], f1
    assert not failing["broken"]
    o1 = other["updates"][0]
    assert not o1["summary"]["ok"] and "sender aborted update 1" in o1["summary"]["error"]
    want1 = {n: (digest(t), str(t.dtype), list(t.shape)) for n, t in model_tensors(1).items()}
    # Every agreed bucket arrived, verified and was loaded: all of update 1, reported as such.
    assert o1["digests"] == want1 and not o1["summary"]["consistent"], o1
    # The same collectives on every rank (the group is in step), and it still works.
    assert failing["sizes"] == other["sizes"] == sender["sizes"]
    want2 = {n: (digest(t), str(t.dtype), list(t.shape)) for n, t in model_tensors(2).items()}
    assert sender["acks"] == [1, 2]
    assert failing["second"]["ok"] and failing["digests"] == want2, failing["second"]
    assert other["updates"][1]["summary"]["ok"] and other["updates"][1]["digests"] == want2
    assert other["updates"][1]["summary"]["consistent"]


# ---------------------------------------------------------------- tensors larger than a bucket

def row_receiver_proc(cfg: dict, rows: bool) -> dict:
    """Receives one update into a module (`ModuleLoader`, which loads rows in place) or, with
    `rows=False`, into a loader that cannot take rows; records every `torch.empty` made during
    the update (the only way the receive path allocates: staging a tensor to reassemble it)."""
    from vllm_nccl_sync.engine.loaders import ModuleLoader

    module = torch.nn.Module()
    for n, t in model_tensors(seed=0).items():
        module.register_buffer(n.replace(".", "_"), t.clone())
    names = {n: n.replace(".", "_") for n in model_tensors(seed=0)}
    loader = ModuleLoader(module)
    loader.targets = {n: loader.targets[b] for n, b in names.items()}
    if not rows:
        loader.load_rows = lambda *a: False  # e.g. a sharded destination: reassemble first
    rx = Receiver(SyncConfig(**cfg), 1)
    allocs: list[int] = []
    real = torch.empty

    def spy(*size, **kw):
        t = real(*size, **kw)
        allocs.append(t.numel() * t.element_size())
        return t

    torch.empty = spy
    try:
        summary = rx.receive(loader, timeout_s=60)
    finally:
        torch.empty = real
    rx.close()
    return {"summary": summary, "allocs": allocs,
            "digests": {n: digest(loader.targets[n]) for n in names}}


@pytest.mark.parametrize("rows", [True, False], ids=["rows", "reassembled"])
def test_a_tensor_larger_than_a_bucket_is_loaded_by_rows_without_staging(rows):
    """The 38 KB embedding crosses three 16 KiB buckets, cut on whole rows. A loader that takes
    rows gets each chunk in place as it arrives: the receiver allocates nothing during the
    update (its extra memory stays at the two buffers it holds). A loader that cannot falls back
    to reassembly (one staging copy of the embedding). Both bit-exact."""
    cfg = make_cfg()
    cfg["world_size"] = 2
    sender, got = run_procs([(sender_proc, (cfg, [4])), (row_receiver_proc, (cfg, rows))],
                            DEADLINE)
    assert got["summary"]["ok"] and got["summary"]["tensors"] == len(model_tensors(4))
    want = {n: digest(t) for n, t in model_tensors(4).items()}
    assert got["digests"] == want
    embed = model_tensors(4)["embed.weight"]
    assert embed.nbytes > 2 * cfg["bucket_bytes"] and sender["results"][0]["buckets"] >= 4
    if rows:
        assert sum(got["allocs"]) < 4096, got["allocs"]  # no staging, nothing near a bucket
    else:
        assert embed.nbytes in got["allocs"], got["allocs"]  # the staging copy


# ---------------------------------------------------------------- every failure is its update's

def late_sender_proc(cfg: dict, timed_out, done) -> dict:
    """Pushes version 1 once the receiver's first receive ended (it timed out before any plan);
    keeps its sockets until the receiver is done (a close drops what is queued: LINGER 0)."""
    client = PushClient(SyncConfig(**cfg))
    client.connect()
    assert timed_out.wait(DEADLINE / 2), "the receiver's first receive never ended"
    try:
        r = client.push(model_tensors(seed=1), version=1)
        out = {"ok": True, "acks": sorted(a.rank for a in r.acks)}
    except Exception as e:  # noqa: BLE001 - reported to the test
        out = {"ok": False, "error": str(e)}
    done.wait(DEADLINE / 2)
    client.close()
    return out


def early_receiver_proc(cfg: dict, timed_out, done) -> dict:
    """A receive that times out before any plan, then one that takes the trainer's push."""
    rx = Receiver(SyncConfig(**cfg), 1)
    try:
        first = rx.receive(DigestLoader(), timeout_s=0.5)
        timed_out.set()
        loader = DigestLoader()
        second = rx.receive(loader, timeout_s=60)
    finally:
        done.set()
    rx.close()
    return {"first": first, "second": second, "digests": loader.digests}


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_a_receive_that_timed_out_before_any_plan_leaves_the_next_push_alone(backend):
    """A receiver whose receive timed out before any plan came tells nobody (nobody asked): the
    trainer's next push is accepted, committed and its bytes arrive right, and the receiver's own
    summary of the first receive still reports its timeout."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    timed_out, done = ctx.Event(), ctx.Event()
    cfg = dict(control_port=free_port(), group_port=free_port(), world_size=2,
               bucket_bytes=16 * 1024, timeout_s=30.0, backend=backend)
    sent, got = run_procs([(late_sender_proc, (cfg, timed_out, done)),
                           (early_receiver_proc, (cfg, timed_out, done))], DEADLINE)
    first, second = got["first"], got["second"]
    assert not first["ok"] and "waited 0.5 s for the Plan of an update" in first["error"], first
    assert sent == {"ok": True, "acks": [1]}, sent
    assert second["ok"] and second["version"] == 1, second
    want = {n: (digest(t), str(t.dtype), list(t.shape)) for n, t in model_tensors(1).items()}
    assert got["digests"] == want
