"""Demo: hot-swap the weights of a running vLLM engine from a trainer process.

1. builds a tiny Qwen2-style model locally (no hub) and starts a real vLLM engine on it with the
   `vllm_nccl_sync.Ext` worker extension (CPU when there is no GPU);
2. generates;
3. a separate trainer process holds the same architecture with different weights and pushes them
   (ZeroMQ headers + gloo/NCCL broadcast of exactly the payload bytes);
4. generates again, and checks the engine now answers exactly like transformers does with the
   trainer's weights; the last line is the verdict (PASS/FAIL) with the update's numbers.

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

from vllm_nccl_sync.engine.metrics import ProgressPrinter, push_logged
from vllm_nccl_sync.testing import (
    PROMPTS,
    build_model,
    engine_kwargs,
    hf_greedy,
    make_model,
    vllm_greedy,
)
from vllm_nccl_sync.trainer.push import PushClient
from vllm_nccl_sync.trainer.sync import free_port
from vllm_nccl_sync.wire.config import SyncConfig

MAX_TOKENS = 8


def trainer(cfg: dict, arch: str, seed: int, conn) -> None:
    """The trainer: its own model (other weights), pushed as version 1."""
    import torch

    try:
        model = build_model(arch, seed)
        device = torch.device("cuda", 0) if cfg["backend"] == "nccl" else None
        client = PushClient(SyncConfig(**cfg), device)
        client.connect()

        state = model.to(device or "cpu").state_dict()
        unique = {t.data_ptr(): t for t in state.values()}  # tied weights are sent once
        printer = ProgressPrinter(sum(t.nbytes for t in unique.values()), label="  [trainer] push")
        res = push_logged(client, state, 1, progress=printer)
        printer.finish(res)
        client.close()
        conn.send(("ok", {"bytes": res.bytes, "buckets": res.buckets, "tensors": res.tensors,
                          "seconds": res.seconds, "gbps": res.gbps,
                          "expected": hf_greedy(model.cpu(), PROMPTS, MAX_TOKENS)}))
    except BaseException as e:
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


def run(args: argparse.Namespace) -> int:
    """Start the engine, generate, take the trainer's push, generate again; 0 if it matches."""
    verbose = getattr(args, "verbose", False)
    if not verbose:
        quiet()
    import torch
    from vllm import LLM

    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    path = make_model(tempfile.mkdtemp(prefix="vllm-nccl-sync-demo-"), args.arch, seed=1)
    print(f"model: tiny {args.arch} at {path}; data plane: {backend}")
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
    before = vllm_greedy(llm, PROMPTS, MAX_TOKENS)
    cfg = dict(control_port=free_port(), group_port=free_port(), world_size=2, backend=backend,
               bucket_bytes=int(args.bucket_mib * 2**20) // 64 * 64, timeout_s=120.0)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=trainer, args=(cfg, args.arch, 2, child), daemon=True)
    proc.start()
    llm.collective_rpc("nccl_sync_join", timeout=150, args=(cfg, 1))
    [summary] = llm.collective_rpc("nccl_sync_receive", timeout=300, args=(120.0,))
    llm.reset_prefix_cache()  # cached KV came from the old weights
    if not parent.poll(150):
        print("FAIL: the trainer did not report" + (f" (engine log: {log})" if log else ""))
        return 1
    status, pushed = parent.recv()
    proc.join(timeout=30)
    if status != "ok" or not summary["ok"]:
        print(f"FAIL: the update failed: trainer={pushed!r} engine={summary!r}"
              + (f" (engine log: {log})" if log else ""))
        return 1
    after = vllm_greedy(llm, PROMPTS, MAX_TOKENS)

    for i, p in enumerate(PROMPTS):
        print(f"prompt {p}\n  before: {before[i]}\n  after:  {after[i]}\n"
              f"  trainer (transformers): {pushed['expected'][i]}")
    ok = after == pushed["expected"] and after != before
    llm.collective_rpc("nccl_sync_close", timeout=30)
    n = len(PROMPTS)
    same = sum(a == e for a, e in zip(after, pushed["expected"]))
    changed = sum(a != b for a, b in zip(after, before))
    print(f"{'PASS' if ok else 'FAIL'}: the running engine took version {summary['version']} "
          f"({pushed['bytes'] / 1e6:.2f} MB, {pushed['tensors']} tensors in {pushed['buckets']} "
          f"buckets, {pushed['seconds'] * 1e3:.1f} ms, {pushed['gbps']:.2f} GB/s over {backend}) "
          f"and now generates exactly like the trainer's model on {same}/{n} prompts "
          f"({changed}/{n} changed)" + (f"; engine log: {log}" if log and not ok else ""),
          flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
