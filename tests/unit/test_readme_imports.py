"""Every import line the README and docs/ show users runs as written, each in a fresh process
(so a moved module or a renamed name is caught where users copy it from)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
IMPORT = re.compile(
    r"^\+?\s*((?:from vllm_nccl_sync[\w.]* import [^#(]+)|(?:import vllm_nccl_sync[\w.]*))")
"""An import of this package on one line (a diff's `+` dropped), without a trailing comment."""


def _lines() -> list[tuple[str, str]]:
    found: dict[str, str] = {}
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            if m := IMPORT.match(line):
                found.setdefault(m.group(1).strip(), f"{doc.relative_to(ROOT)}:{n}")
    return sorted((where, stmt) for stmt, where in found.items())


LINES = _lines()


def test_the_docs_show_imports():
    assert any(w.startswith("README.md") for w, _ in LINES), "no import line found in README.md"


@pytest.mark.parametrize("where,statement", LINES, ids=[w for w, _ in LINES])
def test_an_import_line_runs_as_written(where, statement):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run([sys.executable, "-c", statement], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, f"{where}: `{statement}` failed:\n{out.stderr[-2000:]}"
