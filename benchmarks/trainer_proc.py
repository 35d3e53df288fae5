"""`bench_pause.py --trainer-process`: the trainer's `PushClient` in a process of its own.

In an RL job the trainer and the engine's front end (the `AsyncLLM` that streams tokens to
clients) are different processes. `bench_pause.py` is the front end; with this option its
`WeightSync` drives a `RemoteClient`, whose `connect`/`push` run in a spawned child holding the
real `PushClient` and its own copy of the tensors (the same values as the parent's), so the push's
host work never shares an interpreter with the token stream it is measured against. `verified`
(a push received beside serving) is relayed back when the child's push calls it.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

from vllm_nccl_sync.outcomes import PushError
from vllm_nccl_sync.trainer.tensors import PushResult


def host_tensors(layers: int, seed: int = 1234) -> dict[str, Any]:
    """The model's bf16 tensors on the host, drawn fast: slices of one random pool at offsets
    that differ per tensor (every byte nonzero-random, every tensor distinct)."""
    import torch

    import bench_vllm_gpu as bvg

    g = torch.Generator().manual_seed(seed)
    pool = torch.empty(1 << 26, dtype=torch.bfloat16).normal_(generator=g)
    out = {}
    for i, (name, shape) in enumerate(bvg.model_spec(layers)):
        t = torch.empty(shape, dtype=torch.bfloat16)
        flat, pos, off = t.view(-1), 0, (i * 1_000_003) % pool.numel()
        while pos < flat.numel():
            take = min(flat.numel() - pos, pool.numel() - off)
            flat[pos:pos + take].copy_(pool[off:off + take])
            pos, off = pos + take, 0
        out[name] = t
    return out


def _serve(conn: Any, cfg: dict, layers: int, dims: dict, threads: int) -> None:
    import torch

    import bench_vllm_gpu as bvg
    from vllm_nccl_sync.trainer.push import PushClient
    from vllm_nccl_sync.wire.config import SyncConfig

    if threads:
        torch.set_num_threads(threads)
    bvg.DIMS.update(dims)
    tensors = host_tensors(layers)
    client = PushClient(SyncConfig.from_dict(cfg))
    while True:
        what, args = conn.recv()
        try:
            if what == "expected":
                out: Any = bvg.checksums(bvg.vllm_layout(tensors))
            elif what == "connect":
                out = client.connect()
            elif what == "push":
                version, staged, relay = args
                r = client.push(tensors, version, staged=staged,
                                verified=(lambda: conn.send(("verified", None))) if relay else None)
                out = {"version": r.version, "buckets": r.buckets, "bytes": r.bytes,
                       "tensors": r.tensors, "seconds": r.seconds}
            elif what == "close":
                client.close()
                conn.send(("done", None))
                return
            else:
                raise ValueError(what)
            conn.send(("done", out))
        except Exception as e:  # noqa: BLE001 - raised in the parent
            conn.send(("error", f"{type(e).__name__}: {e}"))


class RemoteClient:
    """What `WeightSync` uses of a `PushClient`, served by a child process (see the module)."""

    def __init__(self, cfg: Any, layers: int, dims: dict, threads: int = 0,
                 timeout_s: float = 600.0) -> None:
        ctx = mp.get_context("spawn")
        self.cfg, self._timeout = cfg, timeout_s
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, cfg.to_dict(), layers, dims, threads),
                                 daemon=True)
        self._proc.start()

    def _call(self, what: str, *args: Any, verified: Any = None) -> Any:
        self._conn.send((what, args))
        while True:
            if not self._conn.poll(self._timeout):
                raise TimeoutError(f"the trainer process gave no answer to {what!r}")
            kind, out = self._conn.recv()
            if kind == "verified":
                verified()
            elif kind == "error":
                raise PushError(f"trainer process: {out}")
            else:
                return out

    def expected(self) -> dict:
        return self._call("expected")

    def connect(self) -> Any:
        return self._call("connect")

    def check(self, *args: Any, **kwargs: Any) -> None:
        pass  # the child checks its own tensors when it pushes

    def push(self, named_tensors: Any, version: int, *, staged: bool = False,
             verified: Any = None, **kwargs: Any) -> Any:
        out = self._call("push", version, staged, verified is not None, verified=verified)
        return PushResult(acks=[], **out)

    def close(self) -> None:
        try:
            self._call("close")
        finally:
            self._proc.join(30)
