"""GPU, one device: the CUDA IPC plane between two real processes sharing the GPU.

The trainer process pushes with `PushClient(backend="ipc")` (its allocator set to expandable
segments, as training runs often are); the receiver process holds CUDA tensors and loads into
them in place, from the trainer's exported buffers. The receiver's loads are slowed down on the
device (a spin kernel before each bucket's copies), so a sender that refilled a buffer before
the copies out of it had *executed* would corrupt the result, and a receiver that read a buffer
before the sender's pack into it executed would fail the checksum: bit-exactness shows neither
happens. A state dict's large tensors are read where they lie in the trainer's memory (the
trainer zeroes them as soon as its push returns: the engine's copies must have run by its Ack);
with expandable segments they are packed instead. Faults: bytes changed after the trainer
checksummed them, a trainer killed between buckets, a
receiver killed mid-update, a handle claiming more memory than its allocation, headers naming
memory outside what the trainer exported.

Run: `python -m pytest -q -m gpu tests/gpu/test_gpu_ipc.py`.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time

import pytest
import torch

from tests.conftest import free_port
from tests.helpers import push_rewritten, storages
from tests.procs import run_procs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
DEADLINE = 240
BUCKET = 1 << 20


def tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(1500, 1024, generator=g).to(torch.bfloat16),  # 3 buckets
        "layers.0.qkv.weight": torch.randn(384, 256, generator=g).to(torch.float16),
        "layers.0.norm.weight": torch.randn(257, generator=g),
        "layers.0.steps": torch.randint(0, 2**40, (3,), generator=g),
        "layers.1.mlp.weight": torch.randn(700, 512, generator=g).to(torch.bfloat16),
        "head.bias": torch.randn(7, generator=g).double(),
    }


def digests(named: dict[str, torch.Tensor]) -> dict[str, str]:
    return {n: hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                              .numpy().tobytes()).hexdigest() for n, t in named.items()}


def _cfg(**kw) -> dict:
    return dict(control_port=free_port(), group_port=free_port(), world_size=2, backend="ipc",
                bucket_bytes=BUCKET, timeout_s=30.0, **kw)


def trainer(cfg: dict, seeds: list[int], staged: bool = False, die_at: int = -1) -> list[dict]:
    """Pushes each seed's tensors from the GPU; `die_at`: SIGKILL itself while posting that
    bucket of the first update."""
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    import faulthandler

    faulthandler.dump_traceback_later(DEADLINE - 30)  # where it waits, should the test hang
    from vllm_nccl_sync.planes.base import Transport

    if die_at >= 0:
        real, count = Transport.broadcast, {"n": 0}

        def broadcast(self, tensor, src=0, **kw):
            if count["n"] == die_at:
                torch.cuda.synchronize()
                os.kill(os.getpid(), signal.SIGKILL)
            count["n"] += 1
            return real(self, tensor, src, **kw)

        Transport.broadcast = broadcast
    return push_each(cfg, seeds, staged=staged)


def push_each(cfg: dict, seeds: list[int], *, staged: bool = False,
              state_dict: bool = False) -> list[dict]:
    """Pushes each seed's tensors from the GPU (as a stream, or as a state dict whose large
    tensors are read where they lie: how many, `in_place`), zeroing them as soon as the push
    returns: the engine's copies out of them must have run by then."""
    from vllm_nccl_sync import PushClient, SyncConfig

    client = PushClient(SyncConfig(**cfg), torch.device("cuda", 0))
    client.connect()
    out = []
    for seed in seeds:
        named = {n: t.cuda() for n, t in tensors(seed).items()}
        try:
            r = client.push(named if state_dict else named.items(), version=seed, staged=staged)
            out.append({"ok": True, "acks": [a.rank for a in r.acks]}
                       | ({"in_place": len(client.lane.held)} if state_dict else {}))
        except Exception as e:  # noqa: BLE001
            out.append({"ok": False, "error": str(e)})
        for t in named.values():
            t.zero_()
    client.close()
    return out


class SlowLoader:
    """Copies into CUDA tensors in place, each bucket's copies behind a device-side spin."""

    def __init__(self, targets: dict[str, torch.Tensor], spin: int) -> None:
        self.targets, self.spin = targets, spin

    def begin(self) -> None:
        pass

    def load(self, named):
        if self.spin:
            torch.cuda._sleep(self.spin)
        for n, t in named:
            self.targets[n].copy_(t, non_blocking=True)
        return {n for n, _ in named}

    def finish(self) -> None:
        pass

    def abort(self) -> None:
        pass


def receiver(cfg: dict, updates: int, spin: int = 20_000_000, rejoin: dict | None = None,
             of=tensors) -> dict:
    """Receives `updates` updates into CUDA tensors shaped as `of(0)`'s, then (`rejoin`) one
    from a new trainer."""
    from vllm_nccl_sync import SyncConfig
    from vllm_nccl_sync.engine.receiver import Receiver

    torch.cuda.set_device(0)
    targets = {n: torch.zeros_like(t, device="cuda") for n, t in of(0).items()}
    ptrs = {n: t.data_ptr() for n, t in targets.items()}
    rx = Receiver(SyncConfig(**cfg), 1, device=torch.device("cuda", 0))
    out = []
    for _ in range(updates):
        s = rx.receive(SlowLoader(targets, spin), timeout_s=60)
        torch.cuda.synchronize()
        out.append({"summary": s, "digests": digests(targets)})
    rx.close()
    if rejoin is not None:  # a new trainer, a new group
        rx = Receiver(SyncConfig(**rejoin), 1, device=torch.device("cuda", 0))
        s = rx.receive(SlowLoader(targets, spin), timeout_s=60)
        torch.cuda.synchronize()
        out.append({"summary": s, "digests": digests(targets)})
        rx.close()
    return {"updates": out, "in_place": ptrs == {n: t.data_ptr() for n, t in targets.items()}}


def test_ipc_push_is_bit_exact_in_place_and_reuse_waits_for_the_engines_copies():
    cfg, seeds = _cfg(), [1, 2, 3]
    sent, got = run_procs([(trainer, (cfg, seeds)), (receiver, (cfg, len(seeds)))], DEADLINE)
    assert all(s["ok"] and s["acks"] == [1] for s in sent), sent
    for seed, upd in zip(seeds, got["updates"], strict=True):
        assert upd["summary"]["ok"] and upd["summary"]["version"] == seed, upd["summary"]
        assert upd["summary"]["buckets"] >= 5  # the embedding spans buckets
        assert upd["digests"] == digests(tensors(seed))
    assert got["in_place"]


def test_a_trainer_killed_between_buckets_leaves_a_staged_engine_intact_then_a_new_one_updates():
    cfg, again = _cfg(), _cfg()
    _, got, sent = run_procs([(trainer, (cfg, [1], True, 2)),
                              (receiver, (cfg, 1, 0, again)),
                              (trainer, (again, [2], True))], DEADLINE, allow_killed={0})
    first, healed = got["updates"]
    why = first["summary"]["error"]
    assert not first["summary"]["ok"] and ("sender exited" in why or "trainer went away" in why)
    assert first["summary"]["version"] == -1 and first["digests"] == digests(
        {n: torch.zeros_like(t) for n, t in tensors(0).items()})  # nothing loaded
    assert sent == [{"ok": True, "acks": [1]}]
    assert healed["summary"]["ok"] and healed["digests"] == digests(tensors(2))


def dying_receiver(cfg: dict) -> None:
    from vllm_nccl_sync import SyncConfig
    from vllm_nccl_sync.engine import dataplane
    from vllm_nccl_sync.engine.receiver import Receiver

    torch.cuda.set_device(0)
    targets = {n: torch.zeros_like(t, device="cuda") for n, t in tensors(0).items()}

    real = dataplane.ReceivePlane.loaded

    def die(self, seq):  # bucket 0 given back, so the sender reaches bucket 2; bucket 1 held
        if seq == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        real(self, seq)

    dataplane.ReceivePlane.loaded = die
    rx = Receiver(SyncConfig(**cfg), 1, device=torch.device("cuda", 0))
    rx.receive(SlowLoader(targets, 0), timeout_s=60)


def test_a_receiver_killed_mid_update_is_reported_by_the_trainer_well_within_the_timeout():
    cfg = _cfg()
    cfg["timeout_s"] = 600.0  # the report comes from the dead process, not the clock
    sent, _ = run_procs([(trainer, (cfg, [1])), (dying_receiver, (cfg,))], DEADLINE,
                        allow_killed={1})
    assert not sent[0]["ok"] and "rank 1" in sent[0]["error"], sent


def forging_receiver(cfg: dict) -> str:
    import msgspec

    from vllm_nccl_sync import SyncConfig
    from vllm_nccl_sync.engine.receiver import Receiver
    from vllm_nccl_sync.planes import ipc

    real = ipc.IpcTransport._open

    def forged(self, handle, fds, nbytes, keep, sender):
        info = msgspec.msgpack.decode(handle, type=ipc.IpcMemory)
        # past the driver's allocation (the caching allocator's segment may hold more than
        # the export: a claim inside it maps, one beyond it must be refused)
        bigger = msgspec.structs.replace(info, storage_bytes=info.storage_bytes + (1 << 30))
        return real(self, msgspec.msgpack.encode(bigger), fds, nbytes, keep, sender)

    ipc.IpcTransport._open = forged
    torch.cuda.set_device(0)
    try:
        Receiver(SyncConfig(**cfg), 1, device=torch.device("cuda", 0))
    except ValueError as e:
        return str(e)
    return "joined"


def joining_trainer(cfg: dict) -> str:
    from vllm_nccl_sync import PushClient, SyncConfig

    try:
        PushClient(SyncConfig(**cfg), torch.device("cuda", 0)).connect()
    except Exception as e:  # noqa: BLE001
        return type(e).__name__
    return "connected"


def test_a_handle_claiming_more_than_its_allocation_is_refused_before_use():
    cfg = _cfg()
    cfg["timeout_s"] = 10.0
    sent, why = run_procs([(joining_trainer, (cfg,)), (forging_receiver, (cfg,))], DEADLINE)
    assert "its allocation maps" in why and sent != "connected"


def _foreign_memory(q, done) -> None:
    """Another process: exports CUDA memory of its own and says its handle, then waits."""
    import msgspec

    from vllm_nccl_sync.planes import ipc

    torch.cuda.set_device(0)
    held = torch.full((1 << 24,), 7, dtype=torch.uint8, device="cuda")
    q.put(msgspec.msgpack.encode(ipc.share(held.untyped_storage(), torch.device("cuda", 0))))
    done.wait(300)


def in_place_trainer(cfg: dict, seeds: list[int], forge: str = "", theirs: bytes = b""
                     ) -> list[dict]:
    """Pushes each seed's tensors as a state dict from memory allocated the default way (so it
    can be exported): its large tensors are read where they lie. `forge`: headers name a range
    past the segment ("past") or a segment never exported ("unknown"), or every storage is
    announced with `theirs`, the handle of another process's CUDA memory ("foreign")."""
    from vllm_nccl_sync.planes import ipc
    from vllm_nccl_sync.wire.protocol import Source

    if forge == "foreign":
        ipc.IpcTransport._share = lambda self, storage: (theirs, [])
    elif forge:
        real = ipc.IpcTransport.export

        def export(self, t):
            at = real(self, t)
            if at is None:
                return None
            return Source(at.segment, at.offset + (1 << 40)) if forge == "past" else Source(999, 0)

        ipc.IpcTransport.export = export
    return push_each(cfg, seeds, state_dict=True)


def test_a_state_dict_is_read_where_it_lies_bit_exact_and_the_trainer_writes_only_after_the_ack():
    cfg, seeds = _cfg(), [1, 2, 3]
    sent, got = run_procs([(in_place_trainer, (cfg, seeds)), (receiver, (cfg, len(seeds)))],
                          DEADLINE)
    assert all(s["ok"] and s["acks"] == [1] for s in sent), sent
    assert all(s["in_place"] == 8 for s in sent), sent  # every slot: the embedding's 3 chunks
    # in buckets of their own, the 5 others gathered into one
    for seed, upd in zip(seeds, got["updates"], strict=True):
        assert upd["summary"]["ok"] and upd["summary"]["version"] == seed, upd["summary"]
        assert upd["digests"] == digests(tensors(seed))  # loads slowed down on the device
    assert got["in_place"]


def test_a_state_dict_of_hundreds_of_storages_is_read_in_place_bit_exact():
    """400 storages exported before the plan (one handle to a packet, they once outgrew the
    handoff socket's buffer and the plan was refused): each update bit-exact, the second a
    repeat of the first's layout."""
    cfg, seeds = _cfg(), [1, 2]
    _, got = run_procs([(push_rewritten, (cfg, seeds, "cuda")),
                        (receiver, (cfg, len(seeds), 0, None, storages))], DEADLINE)
    for seed, upd in zip(seeds, got["updates"], strict=True):
        assert upd["summary"]["ok"] and upd["summary"]["version"] == seed, upd["summary"]
        assert upd["digests"] == digests(storages(seed))
        assert upd["summary"]["read_in_place"] > 0
    assert [u["summary"]["plan"] for u in got["updates"]] == ["checked", "repeat"]


def test_a_state_dict_under_expandable_segments_arrives_bit_exact():
    """PyTorch 2.11 exports expandable segments over CUDA IPC (read in place); a PyTorch that
    cannot has them packed instead."""
    cfg = _cfg()
    sent, got = run_procs([(trainer_dict_expandable, (cfg,)), (receiver, (cfg, 1))], DEADLINE)
    assert sent["ok"] and sent["in_place"] in (0, 8), sent
    assert got["updates"][0]["summary"]["ok"]
    assert got["updates"][0]["digests"] == digests(tensors(4))


def trainer_dict_expandable(cfg: dict) -> dict:
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    from vllm_nccl_sync import PushClient, SyncConfig

    client = PushClient(SyncConfig(**cfg), torch.device("cuda", 0))
    client.connect()
    client.push({n: t.cuda() for n, t in tensors(4).items()}, version=4)
    held = len(client.lane.held)
    client.close()
    return {"ok": True, "in_place": held}


@pytest.mark.parametrize("forge,why", [
    ("past", "lie past its"),
    ("unknown", "never exported by the sender"),
    ("foreign", "reference counter is not one the sender's process made"),
])
def test_a_header_naming_memory_outside_what_was_exported_is_refused_before_any_load(forge, why):
    import multiprocessing as mp

    cfg, theirs = _cfg(), b""
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    foreign = ctx.Process(target=_foreign_memory, args=(q, done), daemon=True)
    if forge == "foreign":  # started here: the test's processes are daemons, without children
        foreign.start()
        theirs = q.get(timeout=120)
    try:
        sent, got = run_procs([(in_place_trainer, (cfg, [1, 2], forge, theirs)),
                               (receiver_of_refusals, (cfg,))], DEADLINE)
    finally:
        done.set()
        if foreign.is_alive():
            foreign.join(60)
    assert not sent[0]["ok"] and why in sent[0]["error"], sent
    assert got["first"]["version"] == -1 and why in got["first"]["error"]
    assert got["digests"] == digests({n: torch.zeros_like(t) for n, t in tensors(0).items()})


def receiver_of_refusals(cfg: dict) -> dict:
    from vllm_nccl_sync import SyncConfig
    from vllm_nccl_sync.engine.receiver import Receiver

    torch.cuda.set_device(0)
    targets = {n: torch.zeros_like(t, device="cuda") for n, t in tensors(0).items()}
    rx = Receiver(SyncConfig(**cfg), 1, device=torch.device("cuda", 0))
    first = rx.receive(SlowLoader(targets, 0), timeout_s=60)
    rx.receive(SlowLoader(targets, 0), timeout_s=60)
    torch.cuda.synchronize()
    rx.close()
    return {"first": first, "digests": digests(targets)}


def garbling_trainer(cfg: dict, flag: str) -> list[dict]:
    """Pushes seeds 1 and 2 as state dicts, staged; in the second, one byte changes after its
    checksum was computed and before the engine reads it (another writer, a reuse bug), then
    `flag` is made (the receiver reads the second update only once it exists)."""
    from vllm_nccl_sync.trainer.lane import BucketLane

    real, calls = BucketLane._read_in_place, []

    def summed(self, seq):
        got = real(self, seq)
        calls.append(seq)
        if calls.count(0) == 2 and seq == 0:
            torch.cuda.synchronize()  # the trainer's checksums ran
            self.held[-1][0] += 1
            torch.cuda.synchronize()
            open(flag, "w").close()
        return got

    BucketLane._read_in_place = summed
    return push_each(cfg, [1, 2], staged=True, state_dict=True)


def receiver_after(cfg: dict, flag: str) -> dict:
    """`receiver` of two updates, the second read only once `flag` exists (bounded)."""
    from vllm_nccl_sync.engine.dataplane import ReceivePlane

    real, calls = ReceivePlane.begin, []

    def begin(self):
        calls.append(1)
        deadline = time.monotonic() + 60
        while len(calls) == 2 and not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.001)
        real(self)

    ReceivePlane.begin = begin
    return receiver(cfg, 2)


def test_bytes_changed_after_the_trainer_summed_them_are_caught_and_nothing_is_loaded(tmp_path):
    cfg, flag = _cfg(), str(tmp_path / "garbled")
    sent, got = run_procs([(garbling_trainer, (cfg, flag)), (receiver_after, (cfg, flag))],
                          DEADLINE)
    assert sent[0]["ok"] and not sent[1]["ok"] and "corrupted" in sent[1]["error"], sent
    first, second = got["updates"]
    assert first["summary"]["ok"] and not second["summary"]["ok"], second["summary"]
    assert first["digests"] == second["digests"] == digests(tensors(1))  # staged: untouched
