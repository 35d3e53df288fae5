"""verl checkpoint-engine backend `vllm_nccl_sync`: a verl trainer pushes with `PushClient`.

verl (0.9.x, `verl/checkpoint_engine/`) moves weights from the actor workers to the rollout
workers through a `CheckpointEngine` chosen by name from `CheckpointEngineRegistry`; its
`CheckpointEngineManager` calls, per update, `prepare()` on every worker, the class's
`build_topology(...)`, `init_process_group(**kwargs)`, then `send_weights(generator)` on the actor
workers and `receive_weights()` on the rollout workers, then `finalize()`. Importing this module
registers `VllmNcclSyncCheckpointEngine` under `vllm_nccl_sync`, so in a verl config:

    checkpoint_engine.backend: vllm_nccl_sync          (under actor_rollout_ref.rollout)
    checkpoint_engine.custom_backend_module: vllm_nccl_sync.integrations.verl
    checkpoint_engine.engine_kwargs.vllm_nccl_sync: {transport: nccl}

Trainer side: actor rank 0 is rank 0 of the transfer group and streams verl's per-tensor generator
through `PushClient.push` (explicit headers, exact-length buckets, a timeout on every wait, the
failure reported to every side); the other actor ranks only drain the generator (gathering a
full tensor is collective over the actor group). `send_weights` returns the update's metrics.
With `shard`, actor rank 0 collects the generator into a state dict first and pushes it shard
to shard (to actor 0's own `engines` only, below).

Engine side, two ways (the wire protocol is the same, so the trainer side does not change):

* verl's rollout workers (`CheckpointEngineWorker`, next to each vLLM worker): `receive_weights`
  runs a `Receiver` and yields full HF-named tensors to verl's server adapter, which loads them.
  A yielded tensor is valid until the generator is resumed after the last tensor of its bucket.
* vLLM engines running `vllm_nccl_sync.Ext` receive directly into the live model (no copy
  through another process): hand their `EngineHandle`s (`vllm_nccl_sync.integrations.vllm.handles`:
  `collective_rpc` or HTTP) to actor rank 0 as `engines=`. Their workers take the ranks after
  verl's rollout workers; actor rank 0 joins them with the group and runs their receive calls
  beside each push (`trainer.beside`, one bound), reporting their failures with its own.

The group is kept across updates (verl calls `init_process_group` before each one; an unchanged
topology reuses the connection) unless `rebuild_group=True`. A random HMAC secret is made per
group by actor rank 0 and handed out with the topology, so control frames are authenticated.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
from collections.abc import AsyncIterator, Iterable, Iterator
from functools import partial
from typing import Any

import torch

from vllm_nccl_sync.engine.metrics import push_logged
from vllm_nccl_sync.trainer.beside import beside, engine_call_s
from vllm_nccl_sync.trainer.sync import EngineHandle, settle
from vllm_nccl_sync.wire.config import SyncConfig

log = logging.getLogger(__name__)

_DEFAULT = SyncConfig.defaults()
_SPELLING = {"bucket_bytes": "bucket_size", "backend": "transport"}
"""SyncConfig's fields as this engine's arguments spell them."""

NAME = "vllm_nccl_sync"
"""The backend name in verl's registry."""
SUPPORTED = ("0.9.",)
"""verl versions (prefixes) whose checkpoint-engine interface this backend follows."""

try:  # verl is optional: without it the class still works when driven directly (tests, scripts)
    import verl as _verl
    from verl.checkpoint_engine.base import CheckpointEngine as _Base
    from verl.checkpoint_engine.base import CheckpointEngineRegistry
except ImportError:
    _verl = None
    _Base = object
    CheckpointEngineRegistry = None


def _host() -> str:
    """This node's address for the group: Ray's view when Ray runs here, else this host's."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address().strip("[]")
    except ImportError:
        pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


async def _drain(weights: Any) -> None:
    if hasattr(weights, "__aiter__"):
        async for _ in weights:
            pass
    else:
        for _ in weights:
            pass


def _sync_iter(weights: Any, loop: asyncio.AbstractEventLoop) -> Iterable:
    """A plain iterator over `weights` for the push thread (an async one is pulled on `loop`)."""
    if not hasattr(weights, "__aiter__"):
        return weights
    it = weights.__aiter__()

    def gen() -> Iterator:
        while True:
            try:
                yield asyncio.run_coroutine_threadsafe(it.__anext__(), loop).result()
            except StopAsyncIteration:
                return

    return gen()


class _HandOff:
    """A `WeightLoader` that hands each bucket's tensors to the async consumer and waits until it
    has taken them all, so the receive buffer is never refilled under the consumer."""

    def __init__(self, loop: asyncio.AbstractEventLoop, q: asyncio.Queue, timeout_s: float) -> None:
        import threading

        self.loop, self.q, self.timeout = loop, q, timeout_s
        self.taken = threading.Event()
        self.stopped = False

    def begin(self) -> None:
        pass

    def load(self, named: list[tuple[str, torch.Tensor]]) -> set[str]:
        if self.stopped:
            raise RuntimeError("the consumer of receive_weights() stopped early")
        self.taken.clear()
        self.loop.call_soon_threadsafe(self.q.put_nowait, ("batch", named))
        if not self.taken.wait(self.timeout):
            raise TimeoutError(f"receive_weights() consumer took no bucket for {self.timeout} s")
        if self.stopped:
            raise RuntimeError("the consumer of receive_weights() stopped early")
        return {n for n, _ in named}

    def finish(self) -> None:
        pass

    def abort(self) -> None:
        pass


class VllmNcclSyncCheckpointEngine(_Base):
    """verl checkpoint engine over vllm-nccl-sync (see the module docstring).

    Args (verl passes `bucket_size` and, on actors, `is_master`; the rest come from
    `checkpoint_engine.engine_kwargs.vllm_nccl_sync`):
        bucket_size: bytes per bucket; each side holds two buffers of it.
        is_master: actor rank 0 (the sender; hosts the control socket and the group's store).
        transport: the data plane, `nccl` (GPU tensors), `gloo` (CPU), or for verl's hybrid
            engine (rollout and actor sharing each GPU) `ipc` (CUDA IPC). (Not `backend`: verl's
            `CheckpointEngineRegistry.new(backend, ...)` takes that name for the engine's.)
        host: address actor rank 0 binds (default: its Ray node address).
        timeout_s: bound on every wait of an update.
        dtype: cast floating tensors to this dtype before sending (e.g. "bfloat16"; without it,
            to the engines' dtype where the cast is faithful).
        rebuild_group: leave the group after every update (verl calls `finalize`), and build a
            new one for the next.
        force: let engines take a `global_steps` not newer than the one they hold.
        shard: shard to shard (`SyncConfig.shard`): each worker gets only the blocks its
            loaders read. Actor rank 0 then collects verl's generator into a state dict (every
            full tensor held at once) instead of streaming it, and every receiver must publish
            a read set: only `engines` do (verl's rollout workers load full tensors), so
            `build_topology` refuses rollout workers.
        engines: actor rank 0 only: `EngineHandle`s of `Ext` engines it joins and updates
            itself, beside verl's rollout workers (see the module docstring).
    Defaults are `SyncConfig`'s.
    """

    wire_format = "named_tensors"

    def __init__(
        self,
        bucket_size: int = _DEFAULT["bucket_bytes"],
        is_master: bool = False,
        *,
        transport: str = "nccl",
        host: str | None = None,
        timeout_s: float = _DEFAULT["timeout_s"],
        dtype: str | None = None,
        rebuild_group: bool = False,
        force: bool = False,
        shard: bool = _DEFAULT["shard"],
        engines: list[EngineHandle] | None = None,
    ) -> None:
        self.bucket_size = int(bucket_size)
        self.is_master = is_master
        self.transport = transport
        self.host = host
        self.timeout_s = timeout_s
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.rebuild_group = rebuild_group
        self.force = force
        self.shard = shard
        self.engines = list(engines or [])
        SyncConfig.check(**self._sync_fields(), door=type(self).__name__, spelling=_SPELLING)
        self.rank: int | None = None
        self.cfg: SyncConfig | None = None
        self.client: Any = None  # PushClient on actor rank 0
        self.receiver: Any = None  # Receiver on a rollout worker
        self.version = 0
        self.connects = 0

    # ------------------------------------------------------------------ topology

    def prepare(self) -> dict[str, Any]:
        """Actor rank 0 proposes a group (fresh ports, new secret) and reports the one it holds."""
        if not self.is_master:
            return {"master": None}
        fresh = self.sync_config(self.host or _host())
        held = self.cfg.to_dict() if self.cfg is not None and self._connected() else None
        extra = sum(e.workers for e in self.engines)
        return {"master": {"fresh": fresh.to_dict(), "held": held, "engines": extra}}

    def _sync_fields(self) -> dict[str, Any]:
        """This engine's `SyncConfig` fields under SyncConfig's names (2: the least world)."""
        return {"host": self.host, "world_size": 2, "backend": self.transport,
                "bucket_bytes": self.bucket_size, "timeout_s": self.timeout_s,
                "shard": self.shard}

    def sync_config(self, host: str) -> SyncConfig:
        """A fresh group's config: bound on `host`, free ports, a new secret (its world size
        is set by `build_topology`)."""
        return SyncConfig.build(**{**self._sync_fields(), "host": host},
                                secret=secrets.token_hex(16), door=type(self).__name__,
                                spelling=_SPELLING)

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Rank 0: actor 0; ranks 1..: the rollout workers in verl's order, then the workers of
        actor 0's own `engines`; other actors: -1.

        The group actor 0 already holds is kept when its size still fits, else a fresh one.
        Shard to shard refuses rollout workers (they publish no read set)."""
        master = metadata[0]["master"]
        if master is None:
            raise ValueError("actor rank 0 must be the checkpoint engine master (is_master=True)")
        if master["fresh"].get("shard") and rollout_world_size:  # a default may be left out
            raise ValueError(f"shard=True sends only to actor rank 0's own engines: verl's "
                             f"{rollout_world_size} rollout worker(s) load full tensors and "
                             "publish no read set")
        world = 1 + rollout_world_size + master.get("engines", 0)
        held = master["held"]
        cfg = held if held is not None and held["world_size"] == world else {
            **master["fresh"], "world_size": world}
        actor = {"rank": [0] + [-1] * (actor_wg_world_size - 1), "cfg": [cfg] * actor_wg_world_size}
        rollout = {"rank": list(range(1, 1 + rollout_world_size)),
                   "cfg": [cfg] * rollout_world_size}
        return actor, rollout

    def _connected(self) -> bool:
        return self.client is not None or self.receiver is not None

    def _device(self) -> torch.device | None:
        if self.transport != "nccl":
            return None
        return torch.device("cuda", torch.cuda.current_device())

    def init_process_group(self, rank: int, cfg: dict[str, Any]) -> None:
        """Join the group as `rank` (-1: an actor that only drains its generator); blocks until
        every member joined. The group already held is reused if `cfg` is unchanged."""
        from vllm_nccl_sync.engine.receiver import Receiver
        from vllm_nccl_sync.trainer.push import PushClient

        self.rank = rank
        if rank < 0:
            return
        new = SyncConfig.from_dict(cfg)
        if self._connected() and new == self.cfg:
            return
        self._close()
        self.cfg = new
        if rank == 0:
            self.client = PushClient(new, self._device())
            self._join(new)
        else:
            self.receiver = Receiver(new, rank, device=self._device())
        self.connects += 1
        log.info("rank %d joined the vllm_nccl_sync group of %d", rank, new.world_size)

    def _offsets(self) -> list[int]:
        first = self.cfg.world_size - sum(e.workers for e in self.engines)
        return [first + sum(e.workers for e in self.engines[:i]) for i in range(len(self.engines))]

    def _join(self, cfg: SyncConfig) -> None:
        """Host the group while actor 0's own engines join it (each raises what failed)."""
        calls = [partial(e.call, "nccl_sync_join", cfg.to_dict(), off,
                         timeout=engine_call_s(cfg.timeout_s))
                 for e, off in zip(self.engines, self._offsets(), strict=True)]
        joined, answers = beside(calls, self.client.connect, cfg.timeout_s, name="verl-join")
        failed = [a.error for a in [joined, *answers] if a.error is not None]
        if failed:
            self._close()
            raise failed[0]

    def finalize(self) -> None:
        """After each update: leave the group only if `rebuild_group`."""
        if self.rebuild_group:
            self._close()

    def _close(self) -> None:
        for end in (self.client, self.receiver):
            if end is not None:
                end.close()
        self.client = self.receiver = None

    # ------------------------------------------------------------------ data

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, Any]:
        """Push `(name, tensor)`s (a generator, sync or async) as version `global_steps`
        (streamed; with `shard`, collected into a state dict first)."""
        if self.rank is None:
            raise RuntimeError("init_process_group() has not been called")
        if self.rank != 0:
            await _drain(weights)  # producing each full tensor is collective over the actors
            return {}
        version = self.version + 1 if global_steps is None else int(global_steps)
        loop = asyncio.get_running_loop()
        device = self._device()

        def push() -> Any:
            if device is not None:
                torch.cuda.set_device(device)
            named = _sync_iter(weights, loop)
            if self.cfg.shard:  # PushClient sends a stream whole: shard to shard takes a dict
                named = dict(named)
            bound = engine_call_s(self.cfg.timeout_s)
            calls = [partial(e.call, "nccl_sync_receive", self.cfg.timeout_s, timeout=bound)
                     for e in self.engines]
            pushed, answers = beside(
                calls, partial(push_logged, self.client, named, version,
                               dtype=self.dtype, force=self.force),
                self.cfg.timeout_s, name="verl-push")
            return settle(version, pushed, answers, self.engines, self._offsets())

        res = await asyncio.to_thread(push)
        self.version = version
        return {"vllm_nccl_sync/bytes": res.bytes, "vllm_nccl_sync/buckets": res.buckets,
                "vllm_nccl_sync/seconds": res.seconds, "vllm_nccl_sync/gbps": res.gbps}

    async def receive_weights(
        self, global_steps: int | None = None
    ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Yield the update's `(name, tensor)`s bucket by bucket; raises if the update failed."""
        if self.receiver is None:
            raise RuntimeError("this worker has not joined as a receiver (init_process_group)")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        hand = _HandOff(loop, q, self.cfg.timeout_s)
        device = self._device()

        def receive() -> None:
            try:
                if device is not None:
                    torch.cuda.set_device(device)
                out = ("end", self.receiver.receive(hand, self.cfg.timeout_s))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer below
                out = ("end", {"ok": False, "error": repr(e)})
            loop.call_soon_threadsafe(q.put_nowait, out)

        task = loop.run_in_executor(None, receive)
        try:
            while True:
                kind, item = await q.get()
                if kind == "end":
                    if not item.get("ok"):
                        raise RuntimeError(f"vllm_nccl_sync update failed: {item.get('error')}")
                    if global_steps is not None and item.get("version") != global_steps:
                        log.warning("received version %s, verl expected %s",
                                    item.get("version"), global_steps)
                    return
                for name, tensor in item:
                    yield name, tensor
                hand.taken.set()
        finally:
            if not task.done():  # the consumer stopped early: fail this update on every side
                hand.stopped = True
                hand.taken.set()
            await task


def register(name: str = NAME, *, check_version: bool = True) -> type:
    """Register the backend in verl's `CheckpointEngineRegistry` (done on import when verl 0.9.x
    is importable); returns the class."""
    if CheckpointEngineRegistry is None:
        raise ImportError("verl is not importable: nothing to register into")
    if check_version and not _verl.__version__.startswith(SUPPORTED):
        raise RuntimeError(f"vllm_nccl_sync's verl backend follows verl {SUPPORTED}, found "
                           f"{_verl.__version__}; check verl/checkpoint_engine/base.py, then "
                           "call register(check_version=False)")
    CheckpointEngineRegistry.register(name)(VllmNcclSyncCheckpointEngine)
    return VllmNcclSyncCheckpointEngine


if _verl is not None:
    if _verl.__version__.startswith(SUPPORTED):
        register()
    else:
        log.warning("verl %s is not a version this backend was written against %s: not "
                    "registered (call register(check_version=False) to try)",
                    _verl.__version__, SUPPORTED)
