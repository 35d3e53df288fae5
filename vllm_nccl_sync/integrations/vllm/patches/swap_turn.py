"""The engine core's turn that ends an update: the swap, the prefix cache, and the version label.

Upstream: `EngineCore.collective_rpc` (`vllm/v1/engine/core.py`) runs a worker RPC between two
scheduler steps, so no forward pass runs while it does. `Scheduler.reset_prefix_cache`
(`vllm/v1/core/sched/scheduler.py`) then either refuses while requests hold KV blocks
(`BlockPool.reset_prefix_cache`: "some blocks are not freed yet") or, with
`reset_running_requests=True`, preempts every running request, which recomputes its KV on the
new weights in the first step after the update (tens of milliseconds with many long requests).

`pause_mode="carry"` (PipelineRL-style in-flight updates) keeps running requests where they are:
the trainer calls the worker RPC `outcomes.CARRY_RPC`; this patch of `EngineCore.collective_rpc`
begins the swap on every worker (`nccl_sync_swap_open`: it returns once the swap's loads are
queued), then, in the same turn, while the devices copy and the commit round runs, before the
scheduler steps again (and before `nccl_sync_swap` waits for the swap's end):
- marks every request holding blocks as never caching a block again, so a block it fills after
  the swap (whose KV attends to KV computed with the old weights) is never found by another
  request (`SingleTypeKVCacheManager.num_cached_block`, read by `cache_blocks`);
- drops every cached block hash through vLLM's own `KVCacheManager.reset_prefix_cache`, its
  used-blocks check lifted for that one call (blocks in use lose their hash; they are freed
  later as uncached blocks are).
So a request that was running at the swap keeps its KV and continues on the new weights (its
tokens come from two versions), and every request scheduled after the swap computes or finds
only KV of the new weights. The drop no longer waits for the swap's end (1-3 ms of vLLM's own
work, measured in the gap that holds the swap on one H100 and one H200); it runs whatever the
swap's outcome, as it did after it: a swap that fails costs the cache. Without this patch
(another vLLM version, or the plugin not loaded in the engine-core process) the worker answers
that RPC itself, refusing without loading (`CARRY_UNSUPPORTED`), and the trainer swaps that
engine under a `keep` pause instead.

The label: vLLM stamps every step's outputs with the engine core's weight version
(`EngineCore._attach_weight_version`), and the output processor turns those stamps into each
request's `CompletionOutput.weight_versions` spans. An update is live on an engine once the RPC
that ends it returns (`outcomes.ENDS_UPDATE`: a receive, a swap, a carry swap), and that RPC runs
between two scheduler steps; so when every worker reports the update committed (ok, consistent,
one version: `outcomes.committed_version`), this patch sets the label
(`EngineCore.set_weight_version(outcomes.version_label(v))`) in that same turn, before the next
step: the first token sampled with the new weights is the first of the new span, under every
pause mode. A refused, aborted or failed update, an adapter's update, or a worker left
inconsistent changes no label (it stays the last good version's; `nccl_sync_state()` says
`consistent: False`). Each worker's answer then carries `live`: the version, its label and the
wall time (`time.time()`) of the turn it went live in. vLLM without labels (0.26): `live` carries
the version and time only.

Applied from the `vllm.general_plugins` entry point `nccl_sync_carry`, which vLLM loads in the
engine-core process (`EngineCore.__init__`); other versions: not applied, logged (no carry, and
no label set by an update: vLLM's label stays "default").
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from vllm_nccl_sync.integrations.vllm.patches import plugin
from vllm_nccl_sync.outcomes import CARRY_RPC, ENDS_UPDATE, committed_version, version_label

log = logging.getLogger(__name__)

SUPPORTED = ("0.26.", "0.32.")
SWAP = "nccl_sync_swap"
"""The worker RPC the engine core runs for `CARRY_RPC`, after `OPEN`."""
OPEN = "nccl_sync_swap_open"
"""The worker RPC that begins the swap and returns once its loads are queued."""
_NEVER = sys.maxsize  # as a request's count of cached blocks: it caches no further block
_MARK = "_vllm_nccl_sync_carry"


def drop_prefix_cache(scheduler: Any) -> int:
    """Forget every cached block of `scheduler`'s KV cache while requests keep their blocks, and
    stop the running requests from caching blocks again; returns how many requests that is.
    Raises RuntimeError if vLLM's reset still refuses."""
    kv = scheduler.kv_cache_manager
    managers = kv.coordinator.single_type_managers
    held = set()
    for m in managers:
        for rid in m.num_cached_block:
            m.num_cached_block[rid] = _NEVER
            held.add(rid)
    pools = list(dict.fromkeys(m.block_pool for m in managers))
    every = [pool.blocks for pool in pools]
    for pool in pools:
        # The only refusal: blocks still in use.
        pool.get_num_free_blocks = functools.partial(int, pool.num_gpu_blocks - 1)
        # vLLM's reset calls `reset_hash()` on every block (tens of thousands on a GPU); only
        # those holding a hash need it, and each of them is a key of
        # `cached_block_hashes_by_block` (vLLM sets a hash only where it adds that key).
        hashed = getattr(pool, "cached_block_hashes_by_block", None)
        if isinstance(hashed, dict):
            pool.blocks = _Hashed(pool.blocks, list(hashed))
    try:
        if not kv.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset the prefix cache")
    finally:
        for pool, blocks in zip(pools, every, strict=True):
            del pool.get_num_free_blocks
            pool.blocks = blocks
    return len(held)


class _Hashed(list):
    """A pool's block list for one reset: indexed like it, iterating only blocks `ids`."""

    def __init__(self, blocks: list[Any], ids: list[int]) -> None:
        super().__init__(blocks)
        self._ids = ids

    def __iter__(self) -> Any:
        return (list.__getitem__(self, i) for i in self._ids)


def _carry(core: Any, swap: Callable[[str], list[Any]]) -> list[Any]:
    """A carry: the swap begun on every worker (`swap(OPEN)`), the prefix cache dropped, running
    requests kept (see the module), while the devices copy; then the swap's end (`swap(SWAP)`).
    Each worker's answer says how the cache was dropped (`carry`; `started`: `perf_counter()`)."""
    swap(OPEN)  # every worker's loads queued
    t0 = time.perf_counter()
    try:
        mark = {"dropped": True, "requests_kept": drop_prefix_cache(core.scheduler)}
    except Exception as e:  # noqa: BLE001 - vLLM's own reset, running requests preempted
        log.exception("vllm_nccl_sync: prefix-cache drop failed; preempting instead")
        core.scheduler.reset_prefix_cache(reset_running_requests=True)
        mark = {"dropped": True, "requests_kept": 0, "fallback": repr(e)[:300]}
    mark |= {"started": t0, "drop_s": time.perf_counter() - t0}
    out = swap(SWAP)
    for r in out:
        if isinstance(r, dict):
            r["carry"] = mark
    return out


def label(core: Any, out: list[Any]) -> None:
    """Make the version every worker committed in this turn the engine's weight label (where
    this vLLM has labels); each worker's answer says so (`live`). Nothing if any did not."""
    v = committed_version(out)
    if v is None:
        return
    live = {"version": v, "label": "", "time": time.time()}
    setter = getattr(core, "set_weight_version", None)
    if callable(setter):
        live["label"] = version_label(v)
        setter(live["label"])
    for r in out:
        r["live"] = live


def _update_in_turn(orig: Any) -> Any:
    @functools.wraps(orig)
    def collective_rpc(self: Any, method: Any, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        if method not in ENDS_UPDATE:
            return orig(self, method, timeout, args, kwargs)
        if method == CARRY_RPC:
            out = _carry(self, lambda m: orig(self, m, timeout, args, kwargs))
        else:
            out = orig(self, method, timeout, args, kwargs)
        label(self, out)
        return out

    setattr(collective_rpc, _MARK, True)
    return collective_rpc


def install() -> None:
    """Apply the patch in this process where it applies (idempotent; never raises)."""

    def apply() -> None:
        from vllm.v1.engine.core import EngineCore

        if not getattr(EngineCore.collective_rpc, _MARK, False):
            EngineCore.collective_rpc = _update_in_turn(EngineCore.collective_rpc)

    plugin(apply, SUPPORTED, "pause_mode='carry' swaps under a keep pause, and no update sets "
                             "vLLM's weight-version label")
