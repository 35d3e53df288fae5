"""The vLLM worker extension: `--worker-extension-cls vllm_nccl_sync.Ext`.

vLLM appends this class to every worker's bases, so its methods run inside each worker and are
reached with `collective_rpc("nccl_sync_<name>", ...)`. Each is a thin adapter over the worker's
`EngineSession` (made on first use, kept in one attribute; vLLM is imported lazily). Every method
name is prefixed `nccl_sync_` so none can clash with the worker's own. Methods return
msgpack-native values and report failures in their result instead of raising, so a failed update
never takes the engine down.
"""

from __future__ import annotations

from typing import Any


class Ext:
    """Receives weight updates pushed by `vllm_nccl_sync.PushClient` into the running model."""

    _nccl_sync: Any = None  # engine.session.EngineSession, made on first use

    def _nccl_sync_session(self) -> Any:
        if self._nccl_sync is None:
            from vllm_nccl_sync.integrations.vllm.lora import AdapterStore
            from vllm_nccl_sync.integrations.vllm.worker import vllm_session

            self._nccl_sync = vllm_session(self, AdapterStore.for_worker)
        return self._nccl_sync

    def nccl_sync_join(self, cfg: dict[str, Any], rank_offset: int = 1) -> dict[str, Any]:
        """Join the trainer's transfer group; blocks until the trainer's `connect()` meets it.

        This worker's rank is `rank_offset + replica * workers_per_replica + local rank`, from
        vLLM's parallel config (`worker.worker_rank`, shared with the `nccl_sync` backend).
        """
        from vllm_nccl_sync.integrations.vllm.worker import join, loaders
        from vllm_nccl_sync.wire.config import SyncConfig

        return join(self._nccl_sync_session(), SyncConfig.from_dict(cfg), rank_offset, self,
                    loaders(self)).to_dict()

    def nccl_sync_receive(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Receive one update (call while the trainer pushes). Returns this worker's summary."""
        return self._nccl_sync_session().receive(timeout_s).to_dict()

    def nccl_sync_receive_beside(self, timeout_s: float | None = None,
                                 shadow: str = "device") -> dict[str, Any]:
        """Start receiving one staged update while the engine keeps serving, into a shadow copy
        (`shadow`: "device", or "host" memory); returns at once. `nccl_sync_swap` loads it."""
        return self._nccl_sync_session().receive_beside(timeout_s, shadow).to_dict()

    def nccl_sync_swap(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Load the update received beside serving, in place (call with generation paused:
        waits until it is verified everywhere). Returns this worker's summary of the update."""
        session = self._nccl_sync_session()
        return session.swap(_swap_bound(session, timeout_s)).to_dict()

    def nccl_sync_swap_open(self, timeout_s: float | None = None) -> dict[str, Any]:
        """The first half of a carry swap, called by vLLM's engine core (`patches.swap_turn`):
        the swap begins, and this returns once its loads are queued, so the core drops its
        prefix cache while the device copies; `nccl_sync_swap` then waits for the end."""
        session = self._nccl_sync_session()
        session.open_swap(_swap_bound(session, timeout_s))
        return {}

    def nccl_sync_swap_carry(self, timeout_s: float | None = None) -> dict[str, Any]:
        """`nccl_sync_swap` with running requests kept in flight: vLLM's engine core takes this
        call (`patches.swap_turn`) and swaps and drops the prefix cache in one turn; a
        worker it reaches is in an engine whose core did not, and refuses, loading nothing."""
        return self._nccl_sync_session().cannot_carry().to_dict()

    def nccl_sync_state(self) -> dict[str, Any]:
        """Weight version held, consistency, counters and adapter versions of this worker."""
        return self._nccl_sync_session().report()

    def nccl_sync_adapters(self) -> dict[str, Any]:
        """Every LoRA adapter pushed into this worker: committed version, id, rank, targets."""
        return self._nccl_sync_session().adapters()

    def nccl_sync_param_ptrs(self) -> dict[str, int]:
        """Data pointer of every non-empty parameter and buffer (to prove updates are in place)."""
        return self._nccl_sync_session().param_ptrs()

    def nccl_sync_checksums(self, names: list[str] | None = None) -> dict[str, Any]:
        """sha256 of the parameters as this worker holds them, under vLLM's names (`verify`)."""
        return self._nccl_sync_session().checksums(names)

    def nccl_sync_read_set(self) -> dict[str, Any]:
        """Which block of every checkpoint tensor this worker's loaders read (`wire.reads`:
        `{"read_set": ReadSet as builtins, "error": ""}`; on failure `read_set` is None)."""
        import msgspec

        from vllm_nccl_sync.integrations.vllm.reads import read_set_of
        from vllm_nccl_sync.integrations.vllm.worker import reference

        try:
            read_set = read_set_of(self, reference(self.vllm_config))
            return {"read_set": msgspec.to_builtins(read_set), "error": ""}
        except Exception as e:  # noqa: BLE001 - reported, never raised into the engine
            return {"read_set": None, "error": f"{type(e).__name__}: {e}"}

    def nccl_sync_metrics(self) -> dict[str, Any]:
        """This worker's counters, and its `vllm_nccl_sync_*` series as Prometheus text."""
        return self._nccl_sync_session().metrics()

    def nccl_sync_close(self) -> None:
        """Leave the transfer group."""
        if self._nccl_sync is not None:
            self._nccl_sync.close()


def _swap_bound(session: Any, timeout_s: float | None) -> float:
    """A swap's wait: `timeout_s`, else the engine-call bound of the session's timeout."""
    from vllm_nccl_sync.trainer.beside import engine_call_s

    if timeout_s is not None:
        return timeout_s
    return engine_call_s(session.receiver.cfg.timeout_s) if session.receiver is not None else 0.0
