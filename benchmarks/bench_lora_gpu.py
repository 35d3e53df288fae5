"""LoRA adapter updates of a running vLLM engine: this project's push vs vLLM's own file loading.

    python benchmarks/bench_lora_gpu.py --ranks 16,64 --reps 5 --json lora.json   # 2 GPUs
    python benchmarks/bench_lora_gpu.py --trainer-gpu cpu --engine-gpu 0 ...         # 1 GPU, gloo
    python benchmarks/bench_lora_gpu.py --cpu-smoke                               # script check

The engine is a vLLM `LLM` in this process (`CUDA_VISIBLE_DEVICES=--engine-gpu`, in-process engine
core, `load_format="dummy"`, `enable_lora=True`, `max_lora_rank` = the largest rank) on a ~1.2 B
parameter Qwen2-shaped bf16 model (hidden 2048, 16 layers, MLP 8192, 32/8 heads, vocab 128256,
tied embeddings). The trainer is a separate process (`--trainer-gpu`) that draws LoRA tensors on
its device under PEFT's names, for every linear layer (q, k, v, o, gate, up, down), per rank in
`--ranks`; with `--trainer-gpu cpu` (one GPU) the trainer draws them on the host and the update
travels over gloo instead of NCCL. For each rank and repetition both methods get the same tensors:

  ours       `PushClient.push(..., adapter=AdapterSpec(...))` -> `Ext.nccl_sync_receive`: NCCL
             broadcast into the engine, added under an id (repetition 0), then replaced in place
             (repetitions 1..): nothing touches the disk
  vllm_file  the trainer writes `adapter_model.safetensors` + `adapter_config.json` to a local
             directory (as frameworks do today), then the engine loads it with vLLM's own
             `add_lora(LoRARequest(..., load_inplace=True))` (what `/v1/load_lora_adapter` calls)

Times are on this process's clock: from telling the trainer to start until the engine-side call
returned (ours: receive committed; vllm_file: write + load). Bytes: what crosses the wire for the
adapter, beside the bytes of a full-model update (every base weight in bf16); `ours_full` times one
full base-weight push for scale. Afterwards both adapters (same tensors, different ids) must give
the same greedy tokens, and the base weights' checksums must be what they were before the adapter
updates.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MiB = 1 << 20
DIMS = dict(hidden=2048, inter=8192, heads=32, kv_heads=8, vocab=128256, layers=16)
SMOKE_DIMS = dict(hidden=64, inter=128, heads=2, kv_heads=1, vocab=512, layers=2)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 17, 300, 42, 7], [1, 2, 3, 4, 5, 6, 7, 8], [100, 200, 300]]


def module_shapes(d: dict) -> dict[str, tuple[int, int]]:
    """`{module: (out, in)}` of every linear layer LoRA targets."""
    h, i = d["hidden"], d["inter"]
    kv = h // d["heads"] * d["kv_heads"]
    io = {"q_proj": (h, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, h),
          "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    out = {}
    for n in range(d["layers"]):
        for m, shape in io.items():
            part = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            out[f"model.layers.{n}.{part}.{m}"] = shape
    return out


def base_shapes(d: dict) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every base weight (tied embeddings: no `lm_head`)."""
    h = d["hidden"]
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (d["vocab"], h)}
    for module, shape in module_shapes(d).items():
        out[module + ".weight"] = shape
        if module.endswith(("q_proj", "k_proj", "v_proj")):
            out[module + ".bias"] = (shape[0],)
    for n in range(d["layers"]):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"model.layers.{n}.{norm}.weight"] = (h,)
    out["model.norm.weight"] = (h,)
    return out


def full_model_bytes(d: dict) -> int:
    """Bytes of every base weight in bf16."""
    import math

    return 2 * sum(math.prod(s) for s in base_shapes(d).values())


def adapter_tensors(d: dict, rank: int, seed: int, device: str) -> dict:
    """PEFT-named LoRA tensors (bf16) for every linear layer, drawn from `seed`."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for module, (o, i) in module_shapes(d).items():
        base = f"base_model.model.{module}"
        out[base + ".lora_A.weight"] = (torch.randn((rank, i), generator=gen, device=device)
                                        / i ** 0.5).to(torch.bfloat16)
        out[base + ".lora_B.weight"] = (torch.randn((o, rank), generator=gen, device=device)
                                        / rank ** 0.5).to(torch.bfloat16)
    return out


def save_config(path: str, d: dict) -> str:
    from transformers import Qwen2Config

    Qwen2Config(vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["inter"],
                num_hidden_layers=d["layers"], num_attention_heads=d["heads"],
                num_key_value_heads=d["kv_heads"], max_position_embeddings=4096,
                tie_word_embeddings=True).save_pretrained(path)
    return path


# --------------------------------------------------------------------------- trainer process


def trainer(conn, gpu: str, smoke: bool) -> None:
    """Serve the driver's commands: `connect`, `push`, `write`, `full`, `stop` (`gpu` "cpu":
    the trainer's tensors live on the host)."""
    on_cpu = smoke or gpu == "cpu"
    if not on_cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    import safetensors.torch
    import torch

    from vllm_nccl_sync import PushClient, SyncConfig
    from vllm_nccl_sync.wire.protocol import AdapterSpec

    d = SMOKE_DIMS if smoke else DIMS
    device = "cpu" if on_cpu else "cuda:0"
    if not on_cpu:
        torch.cuda.set_device(0)
    client = None
    while True:
        cmd = conn.recv()
        try:
            op = cmd["op"]
            if op == "stop":
                break
            if op == "connect":
                client = PushClient(SyncConfig(**cmd["cfg"]), torch.device(device))
                client.connect()
                conn.send({"ok": True})
                continue
            if op == "full":
                gen = torch.Generator(device=device).manual_seed(cmd["seed"])
                tensors = {n: torch.randn(s, generator=gen, device=device).to(torch.bfloat16)
                           for n, s in base_shapes(d).items()}
                res = client.push(tensors, cmd["version"])
                conn.send({"ok": True, "bytes": res.bytes, "push_s": res.seconds})
                continue
            tensors = adapter_tensors(d, cmd["rank"], cmd["seed"], device)
            if device != "cpu":
                torch.cuda.synchronize()
            spec = AdapterSpec(cmd["name"], cmd["id"], cmd["rank"], float(2 * cmd["rank"]),
                               TARGETS)
            if op == "push":
                res = client.push(tensors, cmd["version"], adapter=spec)
                conn.send({"ok": True, "bytes": res.bytes, "push_s": res.seconds})
            elif op == "write":  # what a framework does today before `load_lora_adapter`
                t0 = time.perf_counter()
                os.makedirs(cmd["dir"], exist_ok=True)
                cpu = {n: t.to("cpu").contiguous() for n, t in tensors.items()}
                safetensors.torch.save_file(cpu, os.path.join(cmd["dir"],
                                                              "adapter_model.safetensors"))
                with open(os.path.join(cmd["dir"], "adapter_config.json"), "w") as f:
                    json.dump({"peft_type": "LORA", "r": spec.rank, "lora_alpha": spec.alpha,
                               "target_modules": TARGETS, "bias": "none"}, f)
                    f.flush()
                    os.fsync(f.fileno())
                nbytes = os.path.getsize(os.path.join(cmd["dir"], "adapter_model.safetensors"))
                conn.send({"ok": True, "bytes": nbytes, "write_s": time.perf_counter() - t0})
        except Exception as e:  # the driver reports it
            conn.send({"ok": False, "error": repr(e)})
    if client is not None:
        client.close()


# --------------------------------------------------------------------------- driver (engine)


def ask(conn, msg: dict, timeout_s: float = 600.0) -> dict:
    conn.send(msg)
    return answer(conn, timeout_s)


def answer(conn, timeout_s: float = 600.0) -> dict:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"trainer did not answer within {timeout_s} s")
    out = conn.recv()
    if not out.get("ok"):
        raise RuntimeError(f"trainer failed: {out.get('error')}")
    return out


def greedy(llm, lora) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], sp,
                        lora_request=lora, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def base_fingerprint(llm) -> tuple:
    """Every base parameter's pointer and sha256 (CPU: of each one held as stored; weights the
    CPU backend packed away are covered by their pointers)."""
    [ptrs] = llm.collective_rpc("nccl_sync_param_ptrs")
    [sums] = llm.collective_rpc("nccl_sync_checksums")
    return ptrs, {n: d["sha256"] for n, d in sums["params"].items() if not d["note"]}


def driver(args) -> dict:
    if not args.cpu_smoke:
        os.environ["CUDA_VISIBLE_DEVICES"] = args.engine_gpu
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
    from vllm import LLM
    from vllm.lora.request import LoRARequest

    from vllm_nccl_sync.integrations.vllm.lora import lora_request
    from vllm_nccl_sync.trainer.sync import free_port

    d = SMOKE_DIMS if args.cpu_smoke else DIMS
    ranks = args.ranks
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=trainer, args=(child, args.trainer_gpu, args.cpu_smoke),
                       daemon=True)
    proc.start()
    tmp = tempfile.mkdtemp(prefix="bench-lora-")
    try:
        path = save_config(os.path.join(tmp, "model"), d)
        kw = {}
        if args.cpu_smoke:
            from vllm_nccl_sync.tiny import engine_kwargs

            kw = engine_kwargs(dtype="bfloat16", max_model_len=256)
        else:
            kw = dict(dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=args.gpu_mem,
                      max_model_len=2048, seed=0)
        # two adapters per rank (ours, vllm_file); CPU kernels read slot -1 as "no adapter"
        slots = 2 * len(ranks) + (1 if args.cpu_smoke else 0)
        t0 = time.perf_counter()
        llm = LLM(model=path, load_format="dummy", skip_tokenizer_init=True, max_num_seqs=16,
                  enable_lora=True, max_lora_rank=max(ranks), max_loras=slots,
                  max_cpu_loras=slots, worker_extension_cls="vllm_nccl_sync.Ext", **kw)
        startup = time.perf_counter() - t0
        cfg = dict(control_port=free_port(), group_port=free_port(), world_size=2,
                   backend="gloo" if args.cpu_smoke or args.trainer_gpu == "cpu" else "nccl",
                   timeout_s=300.0,
                   bucket_bytes=int(args.bucket_mib * MiB))
        conn.send({"op": "connect", "cfg": cfg})
        llm.collective_rpc("nccl_sync_join", timeout=600, args=(cfg, 1))
        answer(conn)
        base_before = base_fingerprint(llm)
        rows, checks = [], {}
        version = 0
        for k, rank in enumerate(ranks):
            ours_id, file_id = 2 * k + 1, 2 * k + 2
            ours, files = [], []
            for rep in range(args.reps):
                seed = 1000 * rank + rep
                version += 1
                t0 = time.perf_counter()
                conn.send({"op": "push", "rank": rank, "seed": seed, "name": f"ours-r{rank}",
                           "id": ours_id, "version": version})
                [s] = llm.collective_rpc("nccl_sync_receive", timeout=600, args=(300.0,))
                got = answer(conn)
                if not s.get("ok"):
                    raise RuntimeError(f"receive failed: {s.get('error')}")
                ours.append({"s": time.perf_counter() - t0, "bytes": got["bytes"]})
                where = os.path.join(tmp, f"adapter-r{rank}-{rep}")
                t0 = time.perf_counter()
                got = ask(conn, {"op": "write", "rank": rank, "seed": seed, "name": "f",
                                 "id": file_id, "dir": where})
                t1 = time.perf_counter()
                llm.llm_engine.add_lora(LoRARequest(f"file-r{rank}", file_id, where,
                                                    load_inplace=rep > 0))
                files.append({"s": time.perf_counter() - t0, "write_s": got["write_s"],
                              "load_s": time.perf_counter() - t1, "bytes": got["bytes"]})
            llm.reset_prefix_cache()
            same = (greedy(llm, lora_request(f"ours-r{rank}", ours_id))
                    == greedy(llm, LoRARequest(f"file-r{rank}", file_id, where)))
            checks[f"r{rank}_same_tokens"] = same
            for method, runs in (("ours", ours), ("vllm_file", files)):
                later = runs[1:] or runs
                row = {"method": method, "rank": rank, "bytes": runs[0]["bytes"],
                       "add_s": runs[0]["s"], "replace_s": statistics.median(r["s"] for r in later)}
                if method == "vllm_file":
                    row["write_s"] = statistics.median(r["write_s"] for r in later)
                    row["load_s"] = statistics.median(r["load_s"] for r in later)
                rows.append(row)
        checks["base_unchanged"] = base_fingerprint(llm) == base_before
        [held] = llm.collective_rpc("nccl_sync_adapters")
        checks["in_place"] = all(h["last_update"].get("in_place", 0) >= 1 for h in held.values()) \
            if args.reps > 1 else None
        version += 1
        t0 = time.perf_counter()
        conn.send({"op": "full", "seed": 7, "version": version})
        [s] = llm.collective_rpc("nccl_sync_receive", timeout=600, args=(300.0,))
        got = answer(conn)
        rows.append({"method": "ours_full", "rank": 0, "bytes": got["bytes"],
                     "add_s": None, "replace_s": time.perf_counter() - t0})
        checks["full_ok"] = bool(s.get("ok"))
        llm.collective_rpc("nccl_sync_close")
        conn.send({"op": "stop"})
        import vllm

        return {"rows": rows, "checks": checks, "startup_s": startup, "backend": cfg["backend"],
                "full_model_bytes": full_model_bytes(d), "vllm": vllm.__version__,
                "dims": d, "reps": args.reps, "smoke": args.cpu_smoke}
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def size(nbytes: int) -> str:
    return f"{nbytes / MiB:.1f} MiB" if nbytes >= MiB else f"{nbytes / 1024:.1f} KiB"


def table(rep: dict) -> str:
    full = rep["full_model_bytes"]
    lines = ["| method | rank | bytes | share of full model | add s | replace s (median) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rep["rows"]:
        add = "-" if r["add_s"] is None else f"{r['add_s']:.3f}"
        extra = ""
        if r["method"] == "vllm_file":
            extra = f" (write {r['write_s']:.3f} + load {r['load_s']:.3f})"
        lines.append(f"| {r['method']} | {r['rank'] or 'full'} | {size(r['bytes'])} | "
                     f"{100 * r['bytes'] / full:.2f} % | {add} | {r['replace_s']:.3f}{extra} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", default="16,64", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--reps", type=int, default=5, help="per rank: 1 add, then replacements")
    p.add_argument("--bucket-mib", type=float, default=256.0)
    p.add_argument("--engine-gpu", default="1")
    p.add_argument("--trainer-gpu", default="0",
                   help="the trainer's GPU, or 'cpu': tensors on the host, pushed over gloo")
    p.add_argument("--gpu-mem", type=float, default=0.5)
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny model, gloo, vLLM CPU build: checks the script, not a measurement")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    if args.cpu_smoke and args.ranks == [16, 64]:
        args.ranks, args.reps, args.bucket_mib = [4, 8], 2, 0.0625
    t0 = time.perf_counter()
    rep = driver(args)
    rep["wall_s"] = time.perf_counter() - t0
    print(table(rep))
    print("checks:", json.dumps(rep["checks"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1)
    bad = [k for k, v in rep["checks"].items() if v is False]
    if bad:
        raise SystemExit(f"checks failed: {bad}")


if __name__ == "__main__":
    main()
