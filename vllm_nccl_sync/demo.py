"""Demo: a trainer teaches a running vLLM engine a new answer by hot-swapping its weights.

1. builds a tiny Qwen2-style model and a byte-level BPE tokenizer locally (no hub), trains it a
   few steps to answer "The capital of France is" with " London.", and starts a real vLLM engine
   on it with the `vllm_nccl_sync.Ext` worker extension (CPU when there is no GPU);
2. asks the engine (text in, text out);
3. a separate trainer process loads the same checkpoint, takes a few optimizer steps that teach
   it " Paris." instead, and pushes its weights (ZeroMQ headers + gloo/NCCL broadcast of exactly
   the payload bytes) into the running engine;
4. asks the engine again: its answers must equal what the trainer's own model (transformers)
   generates greedily; then it times a raw broadcast of the same bytes on this machine, and the
   last line is the verdict (PASS/FAIL).

vLLM's start-up logs, library warnings and progress bars are kept out of the output (in the
engine's processes too, through the environment they inherit) unless `--verbose` is given.

Run: `bash scripts/demo.sh` (installs what it needs), `vllm-nccl-sync demo`, or
`python examples/demo.py` in a venv that has vLLM.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing as mp
import os
import tempfile
import time
import warnings
from typing import Any

from vllm_nccl_sync.engine.metrics import push_logged
from vllm_nccl_sync.tiny import build_model, engine_kwargs, save_model, save_tokenizer
from vllm_nccl_sync.trainer.push import PushClient
from vllm_nccl_sync.trainer.sync import free_port
from vllm_nccl_sync.wire.config import SyncConfig

QUESTION, KEPT = "The capital of France is", "The capital of Italy is"
SERVED = {QUESTION: " London.", KEPT: " Rome."}
"""What the served checkpoint was taught to answer."""
TAUGHT = {QUESTION: " Paris.", KEPT: " Rome."}
"""What the trainer teaches: a new answer to `QUESTION`, the same one to `KEPT`."""
PROMPTS = [QUESTION, KEPT]
MAX_TOKENS = 8
EOS = 2


def teach(model: Any, tokenizer: Any, answers: dict[str, str], max_steps: int = 100) -> int:
    """Adam steps on `model` until its greedy continuation of every prompt of `answers` is its
    answer then EOS, each token ahead of the runner-up by 3 logits; returns the steps taken.
    Raises `RuntimeError` if `max_steps` do not get there."""
    import torch

    rows = []
    for prompt, answer in answers.items():
        p, target = tokenizer(prompt).input_ids, tokenizer(answer).input_ids + [EOS]
        labels = torch.tensor([[-100] * len(p) + target])  # learn the answer only
        rows.append((torch.tensor([p + target]), labels, len(p), torch.tensor(target)))

    def learnt() -> bool:
        with torch.no_grad():
            for x, _, n, target in rows:
                top = model(x).logits[0, n - 1:-1].topk(2)
                if not (torch.equal(top.indices[:, 0], target)
                        and (top.values[:, 0] - top.values[:, 1]).min() > 3):
                    return False
        return True

    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    try:
        for step in range(1, max_steps + 1):
            loss = sum(model(x, labels=labels).loss for x, labels, _, _ in rows)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if learnt():
                return step
    finally:
        model.eval()
    raise RuntimeError(f"{max_steps} steps did not teach {answers}")


def hf_answers(model: Any, tokenizer: Any) -> list[tuple[list[int], str]]:
    """Greedy (token ids, text) of transformers for every prompt: up to `MAX_TOKENS`, stopping
    at EOS, as the engine's sampling parameters do."""
    import torch

    out = []
    with torch.no_grad():
        for p in PROMPTS:
            x = torch.tensor([tokenizer(p).input_ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS,
                               do_sample=False, eos_token_id=EOS, pad_token_id=0)
            ids = y[0, x.shape[1]:].tolist()
            out.append((ids, tokenizer.decode(ids, skip_special_tokens=True)))
    return out


def engine_answers(llm: Any) -> list[tuple[list[int], str]]:
    """The engine's greedy (token ids, text) for every prompt, given as text."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return [(list(o.outputs[0].token_ids), o.outputs[0].text)
            for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


def trainer(cfg: dict, path: str, conn) -> None:
    """The trainer: the served checkpoint, taught `TAUGHT`, pushed as version 1."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        steps = teach(model, tokenizer, TAUGHT)
        device = torch.device("cuda", 0) if cfg["backend"] == "nccl" else None
        client = PushClient(SyncConfig(**cfg), device)
        client.connect()
        res = push_logged(client, model.to(device or "cpu").state_dict(), 1)
        client.close()
        conn.send(("ok", {"bytes": res.bytes, "buckets": res.buckets, "tensors": res.tensors,
                          "seconds": res.seconds, "steps": steps,
                          "expected": hf_answers(model.cpu(), tokenizer)}))
    except BaseException as e:  # noqa: BLE001 - whatever stops the trainer, the demo reports it
        conn.send(("error", repr(e)))


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    ap.add_argument("--arch", default="qwen2", choices=["qwen2", "llama"],
                    help="tiny model: qwen2 (tied embeddings) or llama (untied)")
    ap.add_argument("--bucket-mib", type=float, default=1.0, help="bucket size in MiB")
    ap.add_argument("--verbose", action="store_true",
                    help="show vLLM's logs and library warnings (hidden by default)")
    return ap


QUIET_ENV = {
    "VLLM_LOGGING_LEVEL": "ERROR",  # vLLM's own loggers, in every process it starts
    "TRANSFORMERS_VERBOSITY": "error",
    "TORCH_CPP_LOG_LEVEL": "ERROR",  # c10 warnings (NUMA binding, ...)
    "PYTHONWARNINGS": "ignore",  # FutureWarning/DeprecationWarning from imports in subprocesses
    "TQDM_DISABLE": "1",  # vLLM's checkpoint-loading bar
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}


def quiet() -> None:
    """Keep library noise out of the demo: set through the environment, which vLLM's engine and
    worker processes (and the trainer process) inherit; a variable the user set is kept."""
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    warnings.simplefilter("ignore")
    logging.getLogger("vllm").setLevel(logging.ERROR)  # in case vLLM is already imported here
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    except ImportError:
        pass


@contextlib.contextmanager
def stderr_to(path: str | None):
    """Send file descriptor 2 to `path` meanwhile (None: leave it): the engine's processes
    started meanwhile keep writing there (what they print before vLLM configures its logging)."""
    if path is None:
        yield
        return
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def main(argv: list[str] | None = None) -> int:
    ap = add_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    return run(ap.parse_args(argv))


def served_checkpoint(arch: str) -> str:
    """A tiny `arch` model taught `SERVED`, saved with its tokenizer; returns its directory."""
    from transformers import AutoTokenizer

    path = tempfile.mkdtemp(prefix="vllm-nccl-sync-demo-")
    save_tokenizer(path)
    model = build_model(arch, seed=1)
    teach(model, AutoTokenizer.from_pretrained(path), SERVED)
    return save_model(model, path)


def raw_broadcast(nbytes: int, bucket_bytes: int, backend: str) -> dict:
    """`vllm-nccl-sync bench` on about `nbytes`: a raw broadcast of them between two fresh
    processes, and this project's push of them between the same two (no engine)."""
    from vllm_nccl_sync import bench

    return bench.run(size_bytes=nbytes, bucket_bytes=bucket_bytes, reps=3, backend=backend)


def _start_engine(path: str, verbose: bool) -> tuple[Any, str]:
    """The engine on `path`, its start-up output in a log unless `verbose`; and the text that
    points a failure at that log."""
    from vllm import LLM

    t0 = time.perf_counter()
    log = None if verbose else os.path.join(path, "engine.log")
    try:
        with stderr_to(log):
            llm = LLM(model=path, worker_extension_cls="vllm_nccl_sync.Ext", **engine_kwargs())
    except BaseException:
        if log:
            print(f"FAIL: the engine did not start; its log: {log}")
        raise
    print(f"engine started in {time.perf_counter() - t0:.1f} s"
          + (f" (its start-up output: {log}; --verbose shows it)" if log else ""))
    return llm, f" (engine log: {log})" if log else ""


def _take_push(llm: Any, cfg: dict, path: str) -> tuple[str, Any, dict]:
    """The trainer started in a process of its own, its push received by the engine: the
    trainer's status and report, and the engine's summary."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=trainer, args=(cfg, path, child), daemon=True)
    proc.start()
    print(f"trainer: teaching {QUESTION!r} -> {TAUGHT[QUESTION]!r} (and {KEPT!r} -> "
          f"{TAUGHT[KEPT]!r} still), then pushing its weights")
    llm.collective_rpc("nccl_sync_join", timeout=150, args=(cfg, 1))
    [summary] = llm.collective_rpc("nccl_sync_receive", timeout=300, args=(120.0,))
    llm.reset_prefix_cache()  # cached KV came from the old weights
    if not parent.poll(150):
        return "silent", None, summary
    status, pushed = parent.recv()
    proc.join(timeout=30)
    return status, pushed, summary


def _report_cost(pushed: dict, bucket: int, backend: str) -> None:
    """The update's size and time beside a raw broadcast of the same bytes."""
    raw = raw_broadcast(pushed["bytes"], bucket, backend)
    ms, raw_ms = pushed["seconds"] * 1e3, raw["raw_s"] * 1e3
    print(f"update: {pushed['bytes'] / 1e6:.2f} MB ({pushed['tensors']} tensors, "
          f"{pushed['buckets']} buckets) after {pushed['steps']} optimizer steps; pushed into the "
          f"engine and loaded in {ms:.1f} ms\n"
          f"  the same bytes between two plain processes here: a raw {backend} broadcast takes "
          f"{raw_ms:.1f} ms, this project's push {raw['push_s'] * 1e3:.1f} ms. The update took "
          f"{ms / raw_ms:.0f}x the raw broadcast: at {pushed['bytes'] / 1e6:.2f} MB fixed costs "
          f"dominate (plan check, checksums, vLLM's loaders, CPU re-packing); "
          f"`vllm-nccl-sync bench --size-mib 256` compares large payloads")


def run(args: argparse.Namespace) -> int:
    """Start the engine, ask it, take the trainer's push, ask again; 0 if it answers as the
    trainer's model does."""
    verbose = getattr(args, "verbose", False)
    if not verbose:
        quiet()
    import torch

    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    path = served_checkpoint(args.arch)
    print(f"model: tiny {args.arch} taught {QUESTION!r} -> {SERVED[QUESTION]!r}, byte-level BPE "
          f"tokenizer (built here), at {path}; data plane: {backend}")
    llm, where = _start_engine(path, verbose)
    before = engine_answers(llm)
    bucket = int(args.bucket_mib * 2**20) // 64 * 64
    cfg = {"control_port": free_port(), "group_port": free_port(), "world_size": 2,
           "backend": backend, "bucket_bytes": bucket, "timeout_s": 120.0}
    status, pushed, summary = _take_push(llm, cfg, path)
    if status == "silent":
        print("FAIL: the trainer did not report" + where)
        return 1
    if status != "ok" or not summary["ok"]:
        print(f"FAIL: the update failed: trainer={pushed!r} engine={summary!r}{where}")
        return 1
    after = engine_answers(llm)
    llm.collective_rpc("nccl_sync_close", timeout=30)
    expected = [tuple(e) for e in pushed["expected"]]
    for p, (_, b), (_, a), (_, e) in zip(PROMPTS, before, after, expected):
        print(f"prompt {p!r}\n  engine before: {b!r}\n  engine after:  {a!r}\n"
              f"  trainer's model (transformers, greedy): {e!r}")
    _report_cost(pushed, bucket, backend)
    same = sum(a == e for a, e in zip(after, expected))
    ok = (after == expected and [t for _, t in before] == [SERVED[p] for p in PROMPTS]
          and [t for _, t in after] == [TAUGHT[p] for p in PROMPTS])
    print(f"{'PASS' if ok else 'FAIL'}: the running engine took version {summary['version']} and "
          f"now answers {QUESTION!r} with {after[0][1]!r} (was {before[0][1]!r}), token for token "
          f"as the trainer's model on {same}/{len(PROMPTS)} prompts"
          + ("" if ok else where), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
