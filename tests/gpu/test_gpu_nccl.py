"""GPU: a trainer on cuda:0 pushes over NCCL into a model on cuda:1, bit for bit and in place.

Needs two CUDA GPUs (skipped otherwise). The receiving model is a small transformers
Qwen2ForCausalLM (bf16 weights, fp32 norms, tied embeddings, q/k/v biases) when transformers is
installed, else a hand-built module with the same names and shapes. Every check compares exact
per-tensor sha256 digests computed on both sides. Updates go as a state dict (every header in
the plan, one Go) and as streams (headers agreed one, or three, buckets ahead of the wire);
neither side synchronizes the host with the GPU between buckets (CUDA's sync debug mode counts
every synchronizing call: one per update and side, reading the checksums for the Seal); the
8 MiB embedding crosses the small buckets and is loaded by rows, so the receiver's extra memory
is its two buffers.

Run on a machine with 2 GPUs: `python -m pytest -q -m gpu tests/gpu/test_gpu_nccl.py`.
"""

from __future__ import annotations

import hashlib
import os
import warnings

import pytest
import torch

from tests.conftest import free_port
from tests.procs import run_procs
from vllm_nccl_sync import PushClient, SyncConfig
from vllm_nccl_sync.engine.loaders import ModuleLoader
from vllm_nccl_sync.engine.receiver import Receiver
from vllm_nccl_sync.wire.packing import ALIGN


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multiproc,
    pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA GPUs"),
]
DEADLINE = 300
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast (shared hosts)
MiB = 1024 * 1024
VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 16384, 256, 704, 3, 8, 2  # embedding: 8 MiB


# --------------------------------------------------------------------------- the model


class _RMSNorm(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))


class _Attn(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        kv = HIDDEN // HEADS * KV_HEADS
        self.q_proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.k_proj = torch.nn.Linear(HIDDEN, kv)
        self.v_proj = torch.nn.Linear(HIDDEN, kv)
        self.o_proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(HIDDEN, INTER, bias=False)
        self.up_proj = torch.nn.Linear(HIDDEN, INTER, bias=False)
        self.down_proj = torch.nn.Linear(INTER, HIDDEN, bias=False)


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = _Attn()
        self.mlp = _MLP()
        self.input_layernorm = _RMSNorm(HIDDEN)
        self.post_attention_layernorm = _RMSNorm(HIDDEN)


class _Inner(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(VOCAB, HIDDEN)
        self.layers = torch.nn.ModuleList(_Layer() for _ in range(LAYERS))
        self.norm = _RMSNorm(HIDDEN)


class HandBuiltQwen2(torch.nn.Module):
    """Same parameter names and shapes as transformers' Qwen2ForCausalLM (tied embeddings)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _Inner()
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight


def build_model(seed: int, device: torch.device) -> torch.nn.Module:
    """bf16 weights, fp32 norms, tied embeddings; every parameter drawn from `seed`."""
    try:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                          num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                          num_key_value_heads=KV_HEADS, max_position_embeddings=256,
                          tie_word_embeddings=True)
        model = Qwen2ForCausalLM(cfg)
    except ImportError:
        model = HandBuiltQwen2()
    model.to(device=device, dtype=torch.bfloat16)
    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm"):
            m.float()
    redraw(model, seed)
    assert model.lm_head.weight is model.model.embed_tokens.weight, "embeddings must be tied"
    return model.eval()


@torch.no_grad()
def redraw(model: torch.nn.Module, seed: int) -> None:
    """New values for every parameter, in place (storage and pointers unchanged)."""
    for i, (name, p) in enumerate(model.named_parameters()):
        g = torch.Generator(device=p.device).manual_seed(seed * 1009 + i)
        if "norm" in name:
            p.uniform_(0.5, 1.5, generator=g)
        else:
            p.normal_(0.0, 1.0, generator=g)


def digests(model: torch.nn.Module) -> dict[str, str]:
    """Exact per-tensor checksum: sha256 of the raw bytes, with dtype and shape."""
    out = {}
    for name, p in model.named_parameters():
        raw = p.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
        out[name] = f"{p.dtype}{list(p.shape)}:{hashlib.sha256(raw).hexdigest()}"
    return out


# --------------------------------------------------------------------------- guards


class SyncCounter:
    """Forbids device-wide synchronize, counts stream and event synchronizes, and counts every
    synchronizing CUDA call torch makes (`.item()`, `.tolist()`, `.cpu()`, ...) through its sync
    debug mode, while active."""

    def __init__(self) -> None:
        self.stream_syncs = 0
        self.host_syncs = 0
        self._orig_dev = torch.cuda.synchronize
        self._orig_stream = torch.cuda.Stream.synchronize
        self._orig_event = torch.cuda.Event.synchronize
        self._warnings = warnings.catch_warnings(record=True)

    def __enter__(self) -> SyncCounter:
        def no_device_sync(*a, **k):
            raise AssertionError("device-wide torch.cuda.synchronize() inside an update")

        def count(obj):
            self.stream_syncs += 1
            return (self._orig_stream if isinstance(obj, torch.cuda.Stream)
                    else self._orig_event)(obj)

        torch.cuda.synchronize = no_device_sync
        torch.cuda.Stream.synchronize = count
        torch.cuda.Event.synchronize = count
        self._seen = self._warnings.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.set_sync_debug_mode("default")
        self.host_syncs = sum("synchroniz" in str(w.message) for w in self._seen)
        self._warnings.__exit__(*exc)
        torch.cuda.synchronize = self._orig_dev
        torch.cuda.Stream.synchronize = self._orig_stream
        torch.cuda.Event.synchronize = self._orig_event


class SlowLoader(ModuleLoader):
    """Delays every bucket's loads on the GPU: a buffer refilled too early would corrupt them."""

    def __init__(self, module: torch.nn.Module, cycles: int) -> None:
        super().__init__(module)
        self.cycles = cycles

    def load(self, named_tensors):
        torch.cuda._sleep(self.cycles)
        return super().load(named_tensors)


# --------------------------------------------------------------------------- the two processes


def trainer_proc(phases: list[dict], versions: list[int]) -> list[dict]:
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    model = build_model(seed=1, device=dev)
    out = []
    for ph in phases:
        client = PushClient(SyncConfig(**ph["cfg"]), device=dev)
        client.connect()
        for v in versions:
            redraw(model, seed=v)
            want = digests(model)
            moved = client.transport.bytes_moved
            window = ph.get("window")  # None: a state dict, all headers in the plan
            items = (dict(model.named_parameters()) if window is None
                     else model.named_parameters())
            with SyncCounter() as sc:
                r = client.push(items, version=v, window=window or 1)
            out.append({
                "bucket": ph["cfg"]["bucket_bytes"], "version": v, "want": want,
                "bytes": r.bytes, "wire": client.transport.bytes_moved - moved,
                "buckets": r.buckets, "tensors": r.tensors, "acks": [a.rank for a in r.acks],
                "stream_syncs": sc.stream_syncs, "host_syncs": sc.host_syncs,
                "payload": sum(p.numel() * p.element_size() for p in model.parameters()),
                "largest": max(p.numel() * p.element_size() for p in model.parameters()),
            })
        client.close()
    return out


def receiver_proc(phases: list[dict], versions: list[int], slow_cycles: int) -> list[dict]:
    torch.cuda.set_device(1)
    dev = torch.device("cuda", 1)
    model = build_model(seed=999, device=dev)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    names = set(ptrs)
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    out = []
    for ph in phases:
        rx = Receiver(SyncConfig(**ph["cfg"]), 1, device=dev)
        torch.cuda.reset_peak_memory_stats(dev)
        for _ in versions:
            loader = SlowLoader(model, slow_cycles) if slow_cycles else ModuleLoader(model)
            with SyncCounter() as sc:
                summary = rx.receive(loader, timeout_s=120)
            out.append({
                "bucket": ph["cfg"]["bucket_bytes"], "summary": summary, "got": digests(model),
                "all_loaded": loader.loaded == names,
                "ptrs_same": {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs,
                "tied": model.lm_head.weight.data_ptr()
                == model.model.embed_tokens.weight.data_ptr(),
                "stream_syncs": sc.stream_syncs, "host_syncs": sc.host_syncs,
            })
        out[-1]["peak_extra"] = torch.cuda.max_memory_allocated(dev) - base
        rx.close()
        del rx
        torch.cuda.empty_cache()
    return out


def _phases(buckets: list[int], window: int | None = None) -> list[dict]:
    return [{"cfg": dict(backend="nccl", control_port=free_port(), group_port=free_port(),
                         world_size=2, bucket_bytes=b, timeout_s=60.0), "window": window}
            for b in buckets]


def _check(sent: list[dict], got: list[dict]) -> None:
    assert len(sent) == len(got)
    for s, g in zip(sent, got, strict=True):
        where = f"bucket {s['bucket']} version {s['version']}"
        assert g["summary"]["ok"], (where, g["summary"])
        assert g["summary"]["version"] == s["version"], where
        assert s["acks"] == [1], where
        bad = sorted(n for n in s["want"] if g["got"].get(n) != s["want"][n])
        assert not bad, f"{where}: tensors differ after the update: {bad}"
        assert g["got"].keys() == s["want"].keys(), where
        assert g["all_loaded"] and g["ptrs_same"] and g["tied"], (where, g)
        assert s["tensors"] == len(s["want"]), where
        # Exact wire bytes: the payload plus alignment padding, never a buffer's capacity.
        assert s["wire"] == s["bytes"], where
        assert s["payload"] <= s["bytes"] < s["payload"] + ALIGN * (s["tensors"] + s["buckets"])
        # No per-bucket synchronisation: at most one stream synchronize per update on each side,
        # and one synchronizing call (the checksums read for the Seal), whatever the buckets.
        assert s["stream_syncs"] <= 1 and g["stream_syncs"] <= 1, (where, s, g["stream_syncs"])
        assert s["host_syncs"] <= 1 and g["host_syncs"] <= 1, (where, s["host_syncs"],
                                                                g["host_syncs"])
        if "peak_extra" in g:
            # Two preallocated buckets and nothing else: the embedding (larger than the small
            # buckets) is loaded by rows, never staged (slack: checksum scratch, rounding).
            assert g["peak_extra"] <= 2 * s["bucket"] + 2 * MiB, (where, g["peak_extra"])


@pytest.mark.parametrize("window", [None, 1, 3], ids=["state-dict", "stream", "stream-w3"])
def test_nccl_updates_are_bit_exact_and_in_place(window):
    """Three updates per bucket size; 1 MiB and 4 MiB buckets cut the 8 MiB embedding."""
    versions = [11, 12, 13]
    phases = _phases([1 * MiB, 4 * MiB, 256 * MiB], window)
    sent, got = run_procs(
        [(trainer_proc, (phases, versions)), (receiver_proc, (phases, versions, 0))], DEADLINE
    )
    _check(sent, got)
    by_bucket = {s["bucket"]: s["buckets"] for s in sent}
    assert by_bucket[1 * MiB] > by_bucket[4 * MiB] > by_bucket[256 * MiB] == 1


def test_nccl_pipeline_stress_slow_loads():
    """Many updates, small buckets, and loads slowed on the GPU (~1 ms per bucket): a buffer
    refilled before its loads ran, or packed before its broadcast finished, would corrupt bytes."""
    versions = list(range(100, 116))
    phases = _phases([1 * MiB])  # a state dict: every collective queued back to back
    sent, got = run_procs(
        [(trainer_proc, (phases, versions)), (receiver_proc, (phases, versions, 2_000_000))],
        DEADLINE,
    )
    _check(sent, got)
    assert sent[0]["buckets"] >= 10


# --------------------------------------------------------------------------- faults on NCCL


def dying_trainer_proc(cfg: dict, kill_at: int) -> None:
    """Pushes, and is SIGKILLed right after posting its `kill_at`-th collective."""
    import signal

    from vllm_nccl_sync.planes.base import Transport

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    model = build_model(seed=5, device=dev)
    real, calls = Transport.broadcast, []

    def broadcast_then_die(self, tensor, src=0, *, length=None, to=None):
        handle = real(self, tensor, src, length=length, to=to)
        calls.append(1)
        if len(calls) == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return handle

    Transport.broadcast = broadcast_then_die
    client = PushClient(SyncConfig(**cfg), device=dev)
    client.connect()
    client.push(model.named_parameters(), version=2)


def good_trainer_proc(cfg: dict) -> dict:
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    model = build_model(seed=7, device=dev)
    client = PushClient(SyncConfig(**cfg), device=dev)
    client.connect()
    r = client.push(model.named_parameters(), version=3)
    client.close()
    return {"want": digests(model), "buckets": r.buckets}


def surviving_receiver_proc(cfg1: dict, cfg2: dict) -> dict:
    import time

    torch.cuda.set_device(1)
    dev = torch.device("cuda", 1)
    model = build_model(seed=999, device=dev)
    rx = Receiver(SyncConfig(**cfg1), 1, device=dev)
    t0 = time.monotonic()
    first = rx.receive(ModuleLoader(model), timeout_s=120)
    seconds = time.monotonic() - t0
    x = torch.randn(512, 512, device=dev)  # vLLM's stream is untouched: work still runs on it
    stream_ok = bool(torch.isfinite((x @ x).sum()).item())
    broken = rx.broken
    rx.close()
    rx2 = Receiver(SyncConfig(**cfg2), 1, device=dev)
    second = rx2.receive(ModuleLoader(model), timeout_s=120)
    rx2.close()
    return {"first": first, "seconds": seconds, "stream_ok": stream_ok, "broken": broken,
            "second": second, "got": digests(model)}


def test_trainer_killed_mid_collective_engine_side_survives():
    """The trainer dies with a collective posted: the receiver reports within its timeout (at
    once, when the control connection drops), aborts its communicator if the collective is still
    pending (no watchdog tear-down), keeps its CUDA stream usable, re-joins a new trainer and
    receives a full update bit for bit."""
    timeout = 15.0
    # The new trainer waits (its own timeout) while the receiver is still busy failing the first.
    cfg1, cfg2 = ({"backend": "nccl", "control_port": free_port(), "group_port": free_port(),
                   "world_size": 2, "bucket_bytes": 1 * MiB, "timeout_s": t}
                  for t in (timeout, 8 * timeout))
    _, sent, got = run_procs([(dying_trainer_proc, (cfg1, 3)), (good_trainer_proc, (cfg2,)),
                              (surviving_receiver_proc, (cfg1, cfg2))], DEADLINE,
                             allow_killed={0})
    first = got["first"]
    assert not first["ok"] and not first["consistent"], first  # data moved, in place
    assert got["seconds"] < 3 * timeout, got["seconds"]
    # Its communicator was aborted if the collective was still pending when the receiver gave
    # up (else it had completed): either way vLLM's stream still runs work.
    assert got["stream_ok"]
    assert got["second"]["ok"] and got["second"]["consistent"], got["second"]
    assert got["got"] == sent["want"]
