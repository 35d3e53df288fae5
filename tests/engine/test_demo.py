"""The quick start's main command, run as a user runs it (`python examples/demo.py`): a real
vLLM CPU engine answers a prompt as text, a trainer process teaches its copy another answer and
pushes it, and the engine then answers as the trainer's model does."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_demo_passes_and_reads():
    pytest.importorskip("vllm")
    proc = subprocess.run([sys.executable, "examples/demo.py"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("PASS: ") and "' Paris.' (was ' London.')" in lines[-1], out
    assert "  engine before: ' London.'\n  engine after:  ' Paris.'\n" in proc.stdout, out
    assert "trainer's model (transformers, greedy): ' Paris.'" in proc.stdout, out
    assert "a raw gloo broadcast takes" in proc.stdout or "a raw nccl broadcast takes" in out
    assert "Traceback" not in out, out[-4000:]
