"""`examples/rl_loop.py` learns: a real `vllm serve` (CPU) samples, the trainer takes REINFORCE
steps and pushes every round, and the reward for the target token climbs.

Deterministic: fixed model, prompts, target, sampling seeds (per request) and trainer seed; one
trainer thread; nothing asserted depends on timing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROUNDS = 5


def vllm_api_available() -> bool:
    try:
        import vllm_nccl_sync.weight_transfer  # noqa: F401
    except Exception:  # not there, or this vLLM lacks the weight-transfer API
        return False
    return True


@pytest.mark.vllm
@pytest.mark.parametrize("via", ["nccl-sync", "vllm-api"])
def test_rl_loop_reward_climbs(tmp_path, via):
    if via == "vllm-api" and not vllm_api_available():
        pytest.skip("the nccl_sync backend of vLLM's weight-transfer API is not available")
    out = tmp_path / "rewards.json"
    proc = subprocess.run(
        [sys.executable, "examples/rl_loop.py", "--rounds", str(ROUNDS), "--seed", "0",
         "--mode", "keep", "--via", via, "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rewards = json.loads(out.read_text())["rewards"]
    assert len(rewards) == ROUNDS
    # The first round samples the starting policy: the target is rare ...
    assert rewards[0] < 0.1, rewards
    # ... and after a few steps it is most of what the engine samples.
    assert rewards[-1] > rewards[0] + 0.4, rewards
    assert rewards[-1] > max(rewards[:2]), rewards
    # Every round's rollouts came from the weights pushed the round before: the engine's logprobs
    # of its samples are the trainer's.
    gaps = [float(line.rsplit("within ", 1)[1].split()[0]) for line in proc.stdout.splitlines()
            if line.startswith("round ")]
    assert len(gaps) == ROUNDS and max(gaps) < 1e-3, proc.stdout
    assert f"engine holds version {ROUNDS};" in proc.stdout, proc.stdout
