"""Transfer ranks from vLLM's parallel config (`integrations.vllm.worker.worker_rank`), shared by
`Ext` and the
`nccl_sync` weight-transfer backend: unique and dense across TP, PP and DP replicas."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_nccl_sync.integrations.vllm.worker import worker_rank
from vllm_nccl_sync.outcomes import Kind


def _config(tp: int, pp: int, dp: int, rank: int, dp_index: int, launcher: str | None = None):
    world = tp * pp * (dp if launcher == "external_launcher" else 1)
    return SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp, world_size=world,
                           rank=rank, data_parallel_index=dp_index,
                           distributed_executor_backend=launcher)


@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 1), (2, 1, 1), (2, 2, 1), (2, 1, 3), (4, 2, 2)])
def test_ranks_are_unique_and_dense(tp, pp, dp):
    offset = 1
    seen = {}
    for replica in range(dp):
        for local in range(tp * pp):
            where = worker_rank(_config(tp, pp, dp, local, replica), offset)
            assert where.replica == replica and where.tp_size == tp
            assert where.tp_rank == local % tp
            seen[where.rank] = (replica, local)
    assert sorted(seen) == list(range(offset, offset + tp * pp * dp))


def test_external_launcher_ranks_already_span_replicas():
    # world_size and rank include data parallelism: the rank is taken as is
    where = worker_rank(_config(2, 1, 2, rank=3, dp_index=1, launcher="external_launcher"), 1)
    assert where.rank == 4 and where.tp_rank == 1


def test_rank_offset_must_leave_rank_zero_to_the_trainer():
    with pytest.raises(ValueError, match="rank 0 is the trainer"):
        worker_rank(_config(1, 1, 1, 0, 0), 0)


def test_context_parallel_counts_through_world_size():
    """Prefill context parallelism multiplies vLLM's world_size: ranks stay unique and dense
    (computed from world_size and rank, never from TP x PP)."""
    tp, pcp, dp = 2, 2, 2
    seen = set()
    for replica in range(dp):
        for local in range(tp * pcp):
            cfg = SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1,
                                  prefill_context_parallel_size=pcp, world_size=tp * pcp,
                                  rank=local, data_parallel_index=replica,
                                  distributed_executor_backend="mp")
            where = worker_rank(cfg, 1)
            assert where.tp_rank == local % tp
            seen.add(where.rank)
    assert sorted(seen) == list(range(1, 1 + tp * pcp * dp))


def test_replica_from_data_parallel_rank_without_index():
    """vLLM 0.26's ParallelConfig has data_parallel_rank only."""
    cfg = SimpleNamespace(tensor_parallel_size=1, world_size=1, rank=0, data_parallel_rank=2,
                          distributed_executor_backend=None)
    assert worker_rank(cfg, 1).rank == 3 and worker_rank(cfg, 1).replica == 2


@pytest.mark.parametrize("method,refused", [(None, False), ("ngram", False), ("suffix", False),
                                            ("mtp", True), ("eagle3", True),
                                            ("draft_model", True)])
def test_engines_with_a_drafter_are_refused(method, refused):
    """A drafter with weights of its own (MTP head, EAGLE, a draft model) would keep the old
    weights after an in-place update: such engines are refused, saying why and what to do."""
    from vllm_nccl_sync.integrations.vllm.loader import drafter_problem

    spec = None if method is None else SimpleNamespace(method=method)
    why = drafter_problem(SimpleNamespace(speculative_config=spec))
    assert (why is not None) == refused  # a Problem of its own kind, or None
    if refused:
        assert why.kind is Kind.DRAFTER
        assert all(w in why.text for w in (repr(method), "ngram", "speculative_config"))
