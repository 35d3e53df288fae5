"""Transfer ranks from vLLM's parallel config (`worker_glue.worker_rank`), shared by `Ext` and the
`nccl_sync` weight-transfer backend: unique and dense across TP, PP and DP replicas."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_nccl_sync.worker_glue import worker_rank


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
