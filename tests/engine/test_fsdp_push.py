"""A push from a sharded trainer: a 2-process FSDP2 trainer streams full tensors into vLLM.

The trainer is two spawned processes with a gloo default process group (FSDP's, separate from
this package's transfer group). Each builds the tiny transformers model of seed 7 and shards it
with `fully_shard` (per decoder layer, then the root), runs a forward pass (which leaves the
root's parameters unsharded, as training does), and then both ranks run
`sources.full_tensors(model)` in lockstep: rank 0 pushes it with `PushClient.push` (gloo) into a
real vLLM CPU engine that started from seed 1; rank 1 only takes part in each all-gather.
Afterwards the engine's greedy output equals transformers' with the seed-7 weights, token for
token, and rank 0 pushed exactly the model's `state_dict()` names (a tied `lm_head.weight` once).

Before the push, a first lockstep pass checks the generator itself: rank 0 drops each tensor at
once, rank 1 iterates `FSDPWeightSource` (vLLM's `WeightSource` API; every rank yields), checks
that it agrees with its `metadata()` and that every gathered tensor equals the unsharded model's.

Memory, measured on the pushing rank (rank 0). Method: every full tensor the generator yields is
counted from the moment it is yielded until its storage is freed (`weakref.finalize` on the
tensor's storage, so the views and byte views the sender keeps count as the same storage, and a
zero-copy broadcast straight from the tensor keeps it counted until the sender lets go of it),
plus the bytes of the `PushClient`'s two bucket buffers (allocated at `connect()`, held for the
client's life). The count rises only when the generator yields, so it is sampled there; its
maximum is the peak (taken once the previous tensor's storage, which the finished all-gather's
work object may hold for a moment longer, is let go: see `LiveBytes._settle`). Not counted:
what the model holds anyway (its own shards, before and after the push) and scratch inside the
all-gather collective (gloo's CPU all-gather stages the whole gathered tensor once more while it
runs; NCCL gathers in place).

* The generator alone (pass one, each tensor dropped by the consumer): the peak is exactly the
  largest full tensor — one full tensor at a time.
* The push: `PushClient.push` consumes an iterable with `packing.StreamPacker`, which copies
  each tensor into a bucket buffer as soon as it is pulled and lets it go, so the peak is at most
  one full tensor plus the two buffers.

Nothing here depends on wall-clock speed: deadlines only stop a hung run.
"""

from __future__ import annotations

import threading
import time
import weakref

import pytest

from tests.conftest import free_port
from tests.procs import run_procs
from vllm_nccl_sync.tiny import PROMPTS, build_model, engine_kwargs, hf_greedy, make_model

pytestmark = [pytest.mark.multiproc, pytest.mark.vllm]
SEED_ENGINE, SEED_PUSH = 1, 7
MAX_TOKENS = 8
BUCKET = 64 * 1024  # below the largest tensor (embed_tokens, 256 KiB): chunks and zero-copy too
TIMEOUT = 60.0  # every wait of the transfer (a bound against hangs, not a speed requirement)
SETTLE_S = 20.0  # bound on waiting for a finished gather's storage to be let go (`LiveBytes`)


class LiveBytes:
    """Counts the bytes of tensors passed through `track` that are still alive (see module
    docstring), plus a constant `base`; `peak` is the largest count seen at a yield."""

    def __init__(self, base: int = 0) -> None:
        self.base = base
        self.live = 0
        self.peak = base
        self.largest = 0
        self.names: list[str] = []
        self.timed_out = False

    def _free(self, n: int) -> None:
        self.live -= n

    def _settle(self, n: int) -> None:
        """Until only the tensor just yielded (`n` bytes) is counted, or `SETTLE_S` passed. The
        storage of the tensor before it may still be referenced for a moment by the finished
        all-gather's work object, which gloo's worker thread drops just after the waiting thread
        went on (seen: 3 in 400 gathers, not Python garbage: `gc.collect()` does not free them).
        A tensor that the generator or the sender really holds is never freed while they wait
        for this `yield`: it stays counted once the deadline passes (after the first such
        timeout, samples are taken at once)."""
        end = time.monotonic() + SETTLE_S
        while self.live > n and not self.timed_out:
            if time.monotonic() > end:
                self.timed_out = True
                break
            time.sleep(0.001)

    def track(self, named_tensors):
        for name, t in named_tensors:
            storage = t.untyped_storage()
            n = storage.nbytes()
            self.live += n
            weakref.finalize(storage, self._free, n)
            del storage
            self.largest = max(self.largest, n)
            self._settle(n)
            self.peak = max(self.peak, self.base + self.live)
            self.names.append(name)
            yield name, t
            del t


def fsdp_trainer(rank: int, fsdp_port: int, cfg: dict, arch: str, ready) -> dict | None:
    """One rank of the FSDP2 trainer; rank 0 pushes and returns what it measured."""
    import collections
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from vllm_nccl_sync import PushClient, SyncConfig
    from vllm_nccl_sync.trainer.sources import full_tensors

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{fsdp_port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=TIMEOUT * 2))
    try:
        model = build_model(arch, SEED_PUSH)
        mesh = init_device_mesh("cpu", (2,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert all(isinstance(p, DTensor) for p in model.parameters()), "not all sharded"
        with torch.no_grad():  # leaves the root's parameters unsharded (plain tensors)
            model(torch.tensor([PROMPTS[0]]))

        # Pass one: the generator alone. Both ranks gather every parameter, in the same order.
        if rank == 0:
            alone = LiveBytes()
            collections.deque(alone.track(full_tensors(model)), maxlen=0)  # drops each at once
        else:
            from vllm.distributed.weight_transfer import WeightSource

            from vllm_nccl_sync.weight_transfer import FSDPWeightSource

            ref = build_model(arch, SEED_PUSH).state_dict()
            source = FSDPWeightSource(model)
            assert isinstance(source, WeightSource)
            meta = {m.name: m for m in source.metadata()}
            seen = []
            for names, tensors in source.iter_groups():  # vLLM's own order check; all ranks yield
                for name, t in zip(names, tensors, strict=True):
                    m = meta[name]
                    assert (m.dtype, m.shape) == (t.dtype, tuple(t.shape)), name
                    assert not isinstance(t, DTensor), name
                    assert torch.equal(t, ref[name]), f"{name}: gathered values differ"
                    seen.append(name)
            assert seen == list(meta)

        # Pass two: the push.
        if rank != 0:
            yielded = sum(1 for _ in full_tensors(model))  # takes part in every gather
            assert yielded == 0, "a rank other than the pushing one yielded tensors"
            return None
        client = PushClient(SyncConfig(**cfg))
        ready.set()
        try:
            client.connect()
            buffers = sum(b.untyped_storage().nbytes() for b in client.lane.buffers)
            push = LiveBytes(base=buffers)
            res = client.push(push.track(full_tensors(model)), version=1)
        finally:
            client.close()
        import sys

        assert "vllm" not in sys.modules, "the push path imported vLLM"
        return {"names": push.names, "bytes": res.bytes, "buckets": res.buckets,
                "tensors": res.tensors, "alone_peak": alone.peak, "largest": push.largest,
                "buffers": push.base, "push_peak": push.peak}
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def engine(request, tmp_path_factory):
    from vllm import LLM

    arch = request.param
    path = make_model(str(tmp_path_factory.mktemp(f"fsdp_{arch}")), arch, seed=SEED_ENGINE)
    llm = LLM(model=path, worker_extension_cls="vllm_nccl_sync.Ext", **engine_kwargs())
    yield arch, llm
    llm.llm_engine.engine_core.shutdown()


def _generate(llm) -> list[list[int]]:
    from vllm_nccl_sync.tiny import vllm_greedy

    return vllm_greedy(llm, PROMPTS, MAX_TOKENS)


def test_fsdp_trainer_pushes_into_vllm(engine):
    import multiprocessing as mp

    arch, llm = engine
    full = build_model(arch, SEED_PUSH)
    expected = hf_greedy(full, PROMPTS, MAX_TOKENS)
    assert _generate(llm) != expected, "the engine's start weights already give the output"

    cfg = dict(control_port=free_port(), group_port=free_port(), world_size=2,
               bucket_bytes=BUCKET, timeout_s=TIMEOUT, backend="gloo")
    fsdp_port = free_port()
    ready = mp.get_context("spawn").Event()
    out: dict = {}

    def trainers() -> None:
        try:
            out["results"] = run_procs([(fsdp_trainer, (r, fsdp_port, cfg, arch, ready))
                                        for r in range(2)], deadline_s=600)
        except BaseException as e:  # noqa: BLE001  (re-raised by the test below)
            out["error"] = e
        finally:
            ready.set()  # never leave the engine side waiting for a trainer that failed

    thread = threading.Thread(target=trainers, daemon=True)
    thread.start()
    try:
        assert ready.wait(600), "the trainer did not start"
        if "error" not in out:
            llm.collective_rpc("nccl_sync_join", timeout=TIMEOUT * 2, args=(cfg, 1))
            [summary] = llm.collective_rpc("nccl_sync_receive", timeout=TIMEOUT * 6,
                                           args=(TIMEOUT * 4,))
    finally:
        thread.join(660)
    assert not thread.is_alive(), "the trainer processes did not end"
    if "error" in out:
        raise out["error"]
    got = out["results"][0]
    assert summary["ok"], summary
    assert summary["version"] == 1 and summary["consistent"], summary

    # What was pushed: every state_dict name of the unsharded model, a tied alias once.
    names = list(full.state_dict())
    if full.config.tie_word_embeddings:
        names.remove("lm_head.weight")
    assert got["names"] == names
    assert got["tensors"] == len(names)
    assert got["bytes"] == sum(t.numel() * t.element_size() for n, t in full.state_dict().items()
                               if n in names)

    # The engine now computes with the pushed weights.
    assert _generate(llm) == expected

    # Memory on the pushing rank (see the module docstring for the method).
    largest = max(t.numel() * t.element_size() for t in full.state_dict().values())
    assert got["largest"] == largest
    assert got["alone_peak"] == largest, "the generator held more than one full tensor"
    bound = largest + 2 * BUCKET
    print(f"\n[{arch}] peak on the pushing rank: generator alone {got['alone_peak']} B "
          f"(largest tensor {largest} B); push {got['push_peak']} B = buffers {got['buffers']} B "
          f"+ full tensors {got['push_peak'] - got['buffers']} B; one full tensor + two buckets "
          f"{bound} B; model {got['bytes']} B in {got['buckets']} buckets of {BUCKET} B")
    assert got["buffers"] == 2 * BUCKET
    assert got["push_peak"] <= bound
