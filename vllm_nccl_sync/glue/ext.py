"""The vLLM worker extension: `--worker-extension-cls vllm_nccl_sync.Ext`.

vLLM appends this class to every worker's bases, so its methods run inside each worker and are
reached with `collective_rpc("nccl_sync_<name>", ...)`. It is deliberately thin: vLLM is
imported lazily, state lives in one attribute, and the work is done by `Receiver` and
`VllmWeightLoader`. Every method name is prefixed `nccl_sync_` so none can clash with the
worker's own. Methods return msgpack-native values and report failures in their result instead
of raising, so a failed update never takes the engine down.
"""

from __future__ import annotations

from typing import Any


class Ext:
    """Receives weight updates pushed by `vllm_nccl_sync.PushClient` into the running model."""

    _nccl_sync: Any = None  # (Receiver, VllmWeightLoader) once joined
    _nccl_sync_held: Any = None  # ReceiverState: outlives re-joins
    _nccl_sync_lora: Any = None  # lora.AdapterStore (LoRA engines only): outlives re-joins

    def _nccl_sync_state_obj(self) -> Any:
        from vllm_nccl_sync.engine.receiver import ReceiverState

        if self._nccl_sync_held is None:
            self._nccl_sync_held = ReceiverState()
        return self._nccl_sync_held

    def nccl_sync_join(self, cfg: dict[str, Any], rank_offset: int = 1) -> dict[str, Any]:
        """Join the trainer's transfer group; blocks until the trainer's `connect()` meets it.

        This worker's rank is `rank_offset + replica * workers_per_replica + local rank`, from
        vLLM's parallel config (`worker_glue.worker_rank`, shared with the `nccl_sync` backend).
        """
        from vllm_nccl_sync.glue.vllm_loader import VllmWeightLoader
        from vllm_nccl_sync.glue.worker import join
        from vllm_nccl_sync.wire.config import SyncConfig

        if self._nccl_sync is not None:
            self.nccl_sync_close()
        loader = VllmWeightLoader(self)  # refuses, saying why, a model it cannot update in place
        receiver, where = join(SyncConfig.from_dict(cfg), rank_offset, self.vllm_config,
                               self.device, self._nccl_sync_state_obj(),
                               self._nccl_sync_adapters())
        self._nccl_sync = (receiver, loader)
        return where.to_dict()

    def _nccl_sync_adapters(self) -> Any:
        """`AdapterStore.loader` when the engine runs with LoRA enabled, else None."""
        if getattr(self.vllm_config, "lora_config", None) is None:
            return None
        if self._nccl_sync_lora is None:
            from vllm_nccl_sync.glue.lora import AdapterStore
            from vllm_nccl_sync.glue.worker import reference

            self._nccl_sync_lora = AdapterStore.for_worker(self, reference(self.vllm_config))
        return self._nccl_sync_lora.loader

    def nccl_sync_adapters(self) -> dict[str, Any]:
        """Every LoRA adapter pushed into this worker: committed version, id, rank, targets."""
        versions = self._nccl_sync_state_obj().adapters
        held = {} if self._nccl_sync_lora is None else self._nccl_sync_lora.listing()
        return {n: {"version": versions.get(n, -1), **h} for n, h in held.items()}

    def nccl_sync_receive(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Receive one update (call while the trainer pushes). Returns this worker's summary."""
        if self._nccl_sync is None:
            return {"ok": False, "error": "nccl_sync_join has not been called on this worker"}
        receiver, loader = self._nccl_sync
        summary = receiver.receive(loader, timeout_s)
        if summary.get("ok"):
            summary["load"] = dict(loader.stats)  # what loading took (layers re-processed, ...)
        return summary

    def nccl_sync_state(self) -> dict[str, Any]:
        """Weight version held, consistency, and counters of this worker."""
        st = self._nccl_sync_state_obj()
        return {
            "joined": self._nccl_sync is not None,
            "rank": self._nccl_sync[0].rank if self._nccl_sync is not None else -1,
            "version": st.version,
            "consistent": st.consistent,
            "updates": st.updates,
            "failures": st.failures,
            "bytes": st.bytes,
            "last_seconds": st.last_seconds,
            "last_error": st.last_error,
            "adapters": dict(st.adapters),
        }

    def nccl_sync_param_ptrs(self) -> dict[str, int]:
        """Data pointer of every non-empty parameter and buffer (to prove updates are in place)."""
        from vllm_nccl_sync.glue.vllm_loader import param_pointers

        return param_pointers(self.model_runner.model)

    def nccl_sync_checksums(self, names: list[str] | None = None) -> dict[str, Any]:
        """sha256 of parameters as this worker holds them, under vLLM's names (`verify` compares)."""
        from vllm.distributed import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        from vllm_nccl_sync.verify import module_checksums

        return {
            "tp_rank": get_tensor_model_parallel_rank(),
            "tp_size": get_tensor_model_parallel_world_size(),
            "params": module_checksums(self.model_runner.model, names),
        }

    def nccl_sync_metrics(self) -> dict[str, Any]:
        """This worker's counters, and its `vllm_nccl_sync_*` series as Prometheus text."""
        from vllm_nccl_sync.engine.metrics import export_state, prometheus_text

        if self._nccl_sync is not None:
            export_state(self._nccl_sync[0].rank, self._nccl_sync[0].state)
        return {"state": self.nccl_sync_state(), "prometheus": prometheus_text()}

    def nccl_sync_close(self) -> None:
        """Leave the transfer group."""
        if self._nccl_sync is not None:
            self._nccl_sync[0].close()
            self._nccl_sync = None

