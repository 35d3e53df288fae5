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
    """GPU tests skip without a GPU, and GPU tests of a vLLM engine without vLLM (a GPU machine
    may lack it; the CPU tests of an engine never skip: CI installs vLLM)."""
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        skip, needs = pytest.mark.skip(reason="needs a CUDA GPU"), {"gpu"}
    elif importlib.util.find_spec("vllm") is None:
        skip, needs = pytest.mark.skip(reason="needs vLLM"), {"gpu", "vllm"}
    else:
        return
    for item in items:
        if all(k in item.keywords for k in needs):
            item.add_marker(skip)
