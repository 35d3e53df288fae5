"""A small RL loop against a served vLLM engine: sample -> reward -> policy-gradient step -> push.

The engine serves the policy (`vllm serve` with the extension: started here on a tiny local model
whose logits are softened so that sampling explores, or `--url` of one started with
`VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --worker-extension-cls vllm_nccl_sync.Ext`); the trainer
holds a transformers copy of the same weights. Each round:

1. rollouts: the engine samples `--samples` completions of every prompt at temperature 1 (seeded)
   through the OpenAI completions endpoint, with their token ids and logprobs;
2. reward: the fraction of sampled tokens equal to a target token id;
3. a policy-gradient step on the trainer's copy: REINFORCE, baseline = the mean reward of the same
   prompt's samples, one Adam step;
4. push: the new weights go into the running engine as version = round, while another client's
   streamed request is being served (`--mode` says what happens to it during the push). By
   default through this project's API (`WeightSync` + `HTTPHandle`, the engine's `Ext` RPCs);
   `--via vllm-api` goes through vLLM's own weight-transfer API instead (the server started with
   `--weight-transfer-config '{"backend": "nccl_sync"}'`, the trainer holding vLLM's trainer
   engine of that backend): same transfer underneath.

The engine's logprobs of the tokens it sampled are compared with the trainer's logprobs of the same
tokens: they agree to float rounding only if the engine served exactly the weights pushed last
round. The mean reward climbs from a few percent towards 1 within a handful of rounds.

    python examples/rl_loop.py                        # 8 rounds, ~1-2 minutes on 2 CPU cores
    python examples/rl_loop.py --rounds 4 --mode wait --json rewards.json
    python examples/rl_loop.py --via vllm-api
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vllm_nccl_sync.integrations.vllm.handles import HTTPHandle  # noqa: E402
from vllm_nccl_sync.tiny import build_model, save_model, start_server  # noqa: E402
from vllm_nccl_sync.trainer.sync import WeightSync  # noqa: E402

PROMPTS = [[312, 174, 209, 159, 143, 399], [171, 138, 120, 237, 330, 490],
           [321, 403, 465, 465, 153, 188], [315, 487, 94, 42, 325, 118]]
"""Prompts as token ids (all of one length, so rollouts stack without padding)."""


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def rollouts(url: str, model: str, n: int, max_tokens: int, seed: int):
    """`n` samples of every prompt at temperature 1, in one request (one batch on the engine).

    Returns (token ids, the engine's logprob of each), one row per sample, prompt-major."""
    out = post(url, {"model": model, "prompt": PROMPTS, "n": n, "max_tokens": max_tokens,
                     "temperature": 1.0, "top_p": 1.0, "seed": seed,
                     "ignore_eos": True, "return_token_ids": True, "logprobs": 0})
    choices = sorted(out["choices"], key=lambda c: c["index"])  # index = prompt * n + sample
    return ([c["token_ids"] for c in choices],
            [c["logprobs"]["token_logprobs"] for c in choices])


class Stream:
    """Another client's request, streamed (greedy), so that a push happens in the middle of it."""

    def __init__(self, url: str, model: str, max_tokens: int) -> None:
        self.tokens, self.finish, self.started = 0, None, threading.Event()
        self.body = {"model": model, "prompt": PROMPTS[0], "max_tokens": max_tokens,
                     "temperature": 0.0, "ignore_eos": True, "stream": True,
                     "return_token_ids": True}
        self.url = url

    def run(self) -> None:
        req = urllib.request.Request(self.url + "/v1/completions",
                                     data=json.dumps(self.body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                for line in r:
                    if not line.startswith(b"data: {"):
                        continue
                    choice = json.loads(line[6:])["choices"][0]
                    self.tokens += len(choice.get("token_ids") or [])
                    self.finish = choice.get("finish_reason") or self.finish
                    self.started.set()
        finally:
            self.started.set()


def soften(model, scale: float):
    """Scale the final norm, i.e. divide every logit by 1/scale.

    The tiny test models are drawn with large logit gaps (greedy decoding then survives rounding),
    so sampling at temperature 1 would hardly explore; a softer start gives the policy gradient
    something to work with."""
    import torch

    with torch.no_grad():
        model.model.norm.weight.mul_(scale)
    return model


def pick_target(policy, max_prob: float) -> int:
    """The token the policy finds most likely after the prompts, among those under `max_prob`:
    one it says now and then at first, never by habit."""
    import torch

    with torch.no_grad():
        probs = policy(torch.tensor(PROMPTS)).logits[:, -1].softmax(-1).mean(0)
    probs[probs >= max_prob] = 0
    return int(probs.argmax())


class SyncPusher:
    """This project's trainer-side API: `WeightSync` over the engine's `Ext` RPCs."""

    def __init__(self, url: str, policy, mode: str) -> None:
        self.policy, self.mode = policy, mode
        self.sync = WeightSync([HTTPHandle(url)], timeout_s=120)
        self.sync.connect()

    def push(self, version: int):
        return self.sync.update(self.policy.state_dict(), version=version, pause_mode=self.mode)

    def held_version(self) -> str:
        [[state]] = self.sync.state()
        return str(state["version"])

    def close(self) -> None:
        self.sync.close()


class VllmApiPusher:
    """vLLM's weight-transfer API with this project's `nccl_sync` backend: vLLM's trainer
    factory, `ModuleSource` and HTTP client; the server's RL routes; `HTTPHandle` only pauses."""

    def __init__(self, url: str, policy, mode: str) -> None:
        import logging

        # vLLM's CPU build says at import that triton has no CPU backend: not the trainer's concern
        logging.getLogger("vllm.triton_utils").setLevel(logging.ERROR)
        from vllm.distributed.weight_transfer import (
            HTTPVLLMWeightSyncClient,
            ModuleSource,
            WeightTransferTrainerFactory,
        )

        from vllm_nccl_sync.weight_transfer import NcclSyncTrainerInitInfo

        self.url, self.handle, self.mode = url, HTTPHandle(url), mode
        with urllib.request.urlopen(url + "/get_world_size", timeout=30) as r:
            workers = json.loads(r.read())["world_size"]
        info = NcclSyncTrainerInitInfo(world_size=1 + workers, rank=0, timeout_s=120)
        self.trainer = WeightTransferTrainerFactory.trainer_init(
            info, client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(policy))

    def push(self, version: int):
        self.handle.pause(self.mode)
        try:
            return self.trainer.send_weights(version=version)
        finally:
            self.handle.resume()  # and a reset prefix cache: its KV came from the old weights

    def held_version(self) -> str:
        with urllib.request.urlopen(self.url + "/weight_info", timeout=30) as r:
            return json.loads(r.read())["weight_version"]

    def close(self) -> None:
        self.trainer.shutdown()


def show(tokens: list[int], target: int) -> str:
    return " ".join(f"[{t}]" if t == target else str(t) for t in tokens)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running server (else one is started on a tiny model)")
    ap.add_argument("--model", help="the served model's path (with --url)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--samples", type=int, default=16, help="samples per prompt and round")
    ap.add_argument("--tokens", type=int, default=16, help="tokens per sample")
    ap.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    ap.add_argument("--target", type=int,
                    help="token id to reward (default: the policy's most likely token after the "
                    "prompts among those under 4%%)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mode", default="keep", choices=["abort", "wait", "keep"],
                    help="what the push does to requests in flight")
    ap.add_argument("--via", default="nccl-sync", choices=["nccl-sync", "vllm-api"],
                    help="push through this project's API (default) or vLLM's weight-transfer API")
    ap.add_argument("--json", help="write the per-round rewards here")
    args = ap.parse_args(argv)
    if args.url and not args.model:
        ap.error("--url needs --model (the served model's path, for the trainer's copy)")

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # the same float results on any machine; the engine gets the rest
    proc, path = None, args.model
    if args.url:
        url = args.url
    else:
        path = os.path.join(tempfile.mkdtemp(prefix="rl-loop-"), "policy")
        save_model(soften(build_model("qwen2", seed=1), 0.2), path)
        print(f"starting vllm serve on a tiny qwen2 at {path} ...", flush=True)
        t0 = time.perf_counter()
        log = os.path.join(os.path.dirname(path), "server.log")
        extra = (["--weight-transfer-config", json.dumps({"backend": "nccl_sync"})]
                 if args.via == "vllm-api" else [])
        proc, url = start_server(path, log, args=extra)
        print(f"engine up in {time.perf_counter() - t0:.0f} s (its log: {log})", flush=True)
    pusher, rewards = None, []
    try:
        policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # trainer's copy
        opt = torch.optim.Adam(policy.parameters(), lr=args.lr)
        target = pick_target(policy, 0.04) if args.target is None else args.target
        pusher = (VllmApiPusher if args.via == "vllm-api" else SyncPusher)(url, policy, args.mode)
        print(f"engine at {url}; target token {target}; {len(PROMPTS)} prompts x {args.samples} "
              f"samples x {args.tokens} tokens per round; push via {args.via}, pause mode "
              f"{args.mode}", flush=True)
        with ThreadPoolExecutor(1) as pool:
            for step in range(1, args.rounds + 1):
                # 1. rollouts from the engine, which serves version step - 1
                tokens, engine_lp = rollouts(url, path, args.samples, args.tokens,
                                             seed=args.seed * 100_000 + step * 100)
                seqs = torch.tensor([PROMPTS[i // args.samples] + t for i, t in enumerate(tokens)])
                # 2. reward: the share of sampled tokens that are the target
                new = torch.tensor(tokens)
                reward = (new == target).float().mean(1).view(len(PROMPTS), args.samples)
                # 3. REINFORCE with a per-prompt baseline, on the trainer's copy
                n_prompt = len(PROMPTS[0])
                logits = policy(seqs).logits[:, n_prompt - 1:-1]
                logp = logits.log_softmax(-1).gather(-1, new[..., None])[..., 0]
                advantage = (reward - reward.mean(1, keepdim=True)).flatten()
                loss = -(advantage * logp.sum(1)).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                gap = (logp.detach() - torch.tensor(engine_lp)).abs().max().item()
                # 4. push version `step` while another request is being served
                stream = Stream(url, path, max_tokens=200)
                served = pool.submit(stream.run)
                stream.started.wait(60)
                at_push = stream.tokens
                t0 = time.perf_counter()
                res = pusher.push(step)
                push_ms = (time.perf_counter() - t0) * 1e3
                served.result(timeout=300)
                held = pusher.held_version()

                rewards.append(reward.mean().item())
                per_prompt = " ".join(f"{r:.2f}" for r in reward.mean(1).tolist())
                print(f"round {step}: mean reward {rewards[-1]:.3f} (per prompt {per_prompt}); "
                      f"engine vs trainer logprobs within {gap:.1e}", flush=True)
                for i in (0, args.samples):
                    print(f"  sample: {show(tokens[i], target)}")
                print(f"  pushed version {step}: {res.bytes / 1e6:.2f} MB in {res.buckets} "
                      f"buckets, {push_ms:.0f} ms; engine holds version {held}; a "
                      f"streamed request at token {at_push} when the push began ended at token "
                      f"{stream.tokens} ({stream.finish})", flush=True)
    finally:
        if pusher is not None:
            pusher.close()
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    print(f"mean reward per round: {' '.join(f'{r:.3f}' for r in rewards)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": target, "rewards": rewards, "seed": args.seed}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
