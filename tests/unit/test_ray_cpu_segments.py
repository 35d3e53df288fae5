"""The CPU Ray patch's sweep before a rendezvous: a segment a stopped engine left under that port
goes; one a live process maps, another port's, and anything not a vLLM CPU segment stay."""

from __future__ import annotations

import mmap
import os

import pytest

ray_cpu = pytest.importorskip("vllm_nccl_sync.integrations.vllm.patches.ray_cpu")
pytestmark = pytest.mark.skipif(not os.path.isdir(ray_cpu.SHM_DIR), reason="no /dev/shm")


def test_only_unmapped_segments_of_the_rendezvous_port_go():
    ident = f"9{os.getpid()}"
    names = {"stale": f"{ident}-tp:0-[0-1]-cpushm_0", "held": f"{ident}-tp:0-[0-1]-cpushm_1",
             "other_port": f"{ident}1-tp:0-[0-1]-cpushm_0", "not_a_segment": f"{ident}-psm_0"}
    paths = {k: os.path.join(ray_cpu.SHM_DIR, n) for k, n in names.items()}
    for path in paths.values():
        with open(path, "wb") as f:
            f.write(b"\0" * mmap.PAGESIZE)
    try:
        with open(paths["held"], "r+b") as f, mmap.mmap(f.fileno(), mmap.PAGESIZE) as held:
            assert ray_cpu.drop_stale_segments(ident) == [names["stale"]]
            assert [k for k, p in paths.items() if not os.path.exists(p)] == ["stale"]
            held[0] = 1  # still mapped here
        assert ray_cpu.drop_stale_segments(ident) == [names["held"]]  # unmapped now: it goes
        assert os.path.exists(paths["other_port"]) and os.path.exists(paths["not_a_segment"])
    finally:
        for path in paths.values():
            if os.path.exists(path):
                os.unlink(path)
