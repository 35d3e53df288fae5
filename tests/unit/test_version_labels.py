"""The weight-version label: one mapping between this project's versions and vLLM's labels, and
the engine core setting it in the turn that ends an update (with a stand-in core; the real
engine's spans are checked in `test_serving.py` and `test_serving_beside.py`)."""

from __future__ import annotations

import pytest

from vllm_nccl_sync.outcomes import committed_version, label_version, version_label
from vllm_nccl_sync.integrations.vllm.patches.swap_turn import label



def test_versions_and_labels_round_trip():
    for v in (0, 1, 7, 10**12):
        assert label_version(version_label(v)) == v
    for other in ("default", "", "v3", "-1", "1.5"):
        assert label_version(other) == -1  # never mistaken for a version


def ok(version: int, **kw) -> dict:
    return {"ok": True, "rank": 1, "version": version, "consistent": True, **kw}


@pytest.mark.parametrize("results, want", [
    ([ok(3), ok(3)], 3),
    ([ok(3), ok(2)], None),  # workers disagree
    ([ok(3), {**ok(3), "ok": False}], None),  # one failed
    ([ok(3), {**ok(3), "consistent": False}], None),  # one may mix versions
    ([ok(3, adapter="a"), ok(3, adapter="a")], None),  # an adapter: the base label stays
    ([ok(-1)], None),  # the weights it started with
    ([], None),
    (["not a summary"], None),
])
def test_only_an_update_every_worker_committed_is_labelled(results, want):
    assert committed_version(results) == want


class Core:
    """The engine core as the label needs it."""

    def __init__(self, has_labels: bool = True) -> None:
        self.labels: list[str] = []
        if has_labels:
            self.set_weight_version = self.labels.append


def test_the_engine_core_labels_what_every_worker_committed():
    core, out = Core(), [ok(5), ok(5)]
    label(core, out)
    assert core.labels == ["5"]
    assert [(r["live"]["version"], r["live"]["label"]) for r in out] == [(5, "5")] * 2
    failed = [ok(6), {**ok(5), "ok": False}]
    label(core, failed)
    assert core.labels == ["5"] and not any("live" in r for r in failed)


def test_a_vllm_without_labels_still_reports_when_the_update_went_live():
    out = [ok(4)]
    label(Core(has_labels=False), out)
    assert out[0]["live"]["version"] == 4 and out[0]["live"]["label"] == ""
    assert out[0]["live"]["time"] > 0
