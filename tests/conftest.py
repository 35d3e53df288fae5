"""Shared fixtures: free ports, process deadlines, GPU skipping."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
if ROOT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):  # engine workers import the
    os.environ["PYTHONPATH"] = os.pathsep.join(  # tests' extensions (tests.fault_ext, ...)
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)

from vllm_nccl_sync.trainer.sync import free_port  # noqa: E402,F401  (re-exported for the tests)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
