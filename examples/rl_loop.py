"""An RL-style loop against a served engine: generate -> train step -> push -> generate.

Starts `vllm serve` on a tiny local model with the extension (or uses `--url` of one you started
with `VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --worker-extension-cls vllm_nccl_sync.Ext`), then
each round: rolls out over HTTP while the trainer takes a (toy) optimizer step, pushes the new
weights with the chosen pause mode while those rollouts are still in flight, and prints the
version the engine reports and its greedy generations.

    python examples/rl_loop.py --rounds 3 --mode keep
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import urllib.request
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vllm_nccl_sync.engines import HTTPHandle  # noqa: E402
from vllm_nccl_sync.sync import WeightSync  # noqa: E402
from vllm_nccl_sync.testing import PROMPTS, build_model, make_model, start_server  # noqa: E402


def complete(url: str, model: str, prompt: list[int], max_tokens: int) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())["choices"][0]["token_ids"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running server (else one is started on a tiny model)")
    ap.add_argument("--model", help="the served model's path (with --url)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mode", default="keep", choices=["abort", "wait", "keep"])
    args = ap.parse_args()

    import torch

    proc = None
    path = args.model
    if args.url:
        url = args.url
    else:
        path = make_model(tempfile.mkdtemp(prefix="rl-loop-"), "qwen2", seed=1)
        proc, url = start_server(path, os.path.join(os.path.dirname(path), "server.log"))
    policy = build_model("qwen2", seed=1)  # the trainer's copy of the served weights
    opt = torch.optim.SGD(policy.parameters(), lr=0.002)
    sync = WeightSync([HTTPHandle(url)], timeout_s=120)
    sync.connect()
    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            for step in range(1, args.rounds + 1):
                rollouts = [pool.submit(complete, url, path, p, 64) for p in PROMPTS]
                # Toy "training": push the logits of the first prompt towards token 7.
                x = torch.tensor([PROMPTS[0]])
                loss = -policy(x).logits[0, -1].log_softmax(-1)[7]
                opt.zero_grad()
                loss.backward()
                opt.step()
                res = sync.update(policy.state_dict(), version=step, pause_mode=args.mode)
                done = [f.result() for f in rollouts]  # rollouts that straddled the update
                [[state]] = sync.state()
                gens = [complete(url, path, p, 8) for p in PROMPTS[:3]]
                print(f"round {step}: loss {loss.item():.3f}; pushed {res.bytes / 1e6:.2f} MB in "
                      f"{res.buckets} buckets, {res.seconds * 1e3:.0f} ms ({args.mode}); engine "
                      f"holds version {state['version']}; {len(done)} rollouts finished; "
                      f"greedy: {gens}")
    finally:
        sync.close()
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
