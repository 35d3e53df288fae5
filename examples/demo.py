"""Demo: a trainer teaches a running vLLM engine a new answer by hot-swapping its weights.

The logic lives in `vllm_nccl_sync/demo.py` (also `vllm-nccl-sync demo`); this file runs it from
a checkout. Run: `bash scripts/demo.sh` (installs what it needs), or `python examples/demo.py` in
a venv that has vLLM.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vllm_nccl_sync.demo import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
