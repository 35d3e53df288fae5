"""`vllm-nccl-sync`: the demo, a transfer benchmark, and a check of what an engine holds.

    vllm-nccl-sync demo                     # a real vLLM engine hot-swapped from a trainer process
    vllm-nccl-sync bench --size-mib 1024    # push vs raw broadcast, NCCL on 2 GPUs / gloo on CPU
    vllm-nccl-sync verify --checkpoint DIR --url http://127.0.0.1:8000

`verify` needs the engine started with `--worker-extension-cls vllm_nccl_sync.Ext` and, over
HTTP, `VLLM_SERVER_DEV_MODE=1` (it calls the workers' `nccl_sync_checksums` through
`POST /collective_rpc`). Exit status: 0 every comparable tensor matches, 1 some differ, 2 nothing
could be compared (or the command failed).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

MiB = 1024 * 1024


def _write_json(path: str, obj: Any) -> None:
    if path == "-":
        json.dump(obj, sys.stdout, indent=1)
        print()
    elif path:
        with open(path, "w") as f:
            json.dump(obj, f, indent=1)


# --------------------------------------------------------------------------- demo


def cmd_demo(args: argparse.Namespace) -> int:
    from vllm_nccl_sync import demo

    return demo.run(args)


# --------------------------------------------------------------------------- bench


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from vllm_nccl_sync import bench

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    size = args.size_mib if args.size_mib is not None else (1024 if gpus >= 2 else 64)
    bucket = args.bucket_mib if args.bucket_mib is not None else (512 if gpus >= 2 else 16)
    report = bench.run(size_bytes=int(size * MiB), bucket_bytes=int(bucket * MiB) // 64 * 64,
                       reps=args.reps, backend=args.backend, timeout_s=args.timeout,
                       deadline_s=args.deadline, progress=args.progress,
                       lora_rank=args.lora_rank)
    print(bench.format_report(report))
    _write_json(args.json, report)
    return 0 if report["bit_exact"] else 1


# --------------------------------------------------------------------------- verify


def engine_from_args(args: argparse.Namespace) -> Any:
    """The engine handle `verify` talks to (a `vllm serve` in dev mode, by URL)."""
    from vllm_nccl_sync.integrations.vllm.handles import HTTPHandle

    return HTTPHandle(args.url, workers=args.workers, call_timeout_s=args.timeout)


def _reason(detail: str) -> str:
    """A not-comparable detail without the tensor-specific part, to group by."""
    if detail.startswith("as part of") and ": " in detail:
        return "stacked in vLLM, " + detail.split(": ", 1)[1]
    if detail.startswith("engine holds shape"):
        return "shape differs (TP shard or padding)"
    return detail


def print_report(report: Any, show: str, out: Any = None) -> None:
    out = out or sys.stdout
    print(report.summary(), file=out)
    bad = [e for e in report.entries if e.status == "mismatch"]
    for e in bad:
        print(f"  MISMATCH  worker {e.worker}  {e.name}  {e.detail}".rstrip(), file=out)
    nc = [e for e in report.entries if e.status == "not_comparable"]
    if show == "all":
        for e in report.entries:
            if e.status != "mismatch":
                line = f"  {e.status:14s} worker {e.worker}  {e.name}  {e.detail}"
                print(line.rstrip(), file=out)
    elif nc and show == "problems":
        by_reason: dict[str, list[str]] = {}
        for e in nc:
            by_reason.setdefault(_reason(e.detail), []).append(e.name)
        print("  not comparable (only what vLLM keeps in HF layout is compared):", file=out)
        for reason, names in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
            print(f"    {len(names):5d} x {reason}  (e.g. {names[0]})", file=out)
    if report.engine_only and show == "all":
        print(f"  engine-only parameters: {', '.join(report.engine_only)}", file=out)


def cmd_verify(args: argparse.Namespace) -> int:
    from vllm_nccl_sync.verify import verify

    names = [n for n in args.names.split(",") if n] if args.names else None
    report = verify(args.checkpoint, engine_from_args(args), names, timeout=args.timeout)
    print_report(report, args.show)
    _write_json(args.json, report.to_dict())
    if report.count("mismatch"):
        return 1
    return 0 if report.ok else 2


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="vllm-nccl-sync", description=__doc__.splitlines()[0])
    ap.add_argument("--log-json", action="store_true",
                    help="log update events (and everything else) as JSON lines on stderr")
    ap.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING, ...")
    sub = ap.add_subparsers(dest="command", required=True)

    from vllm_nccl_sync.demo import add_arguments

    p = add_arguments(sub.add_parser("demo", help="hot-swap a running vLLM engine's weights "
                                     "(tiny local model, real engine, trainer process)"))
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("bench", help="this project's push vs a raw broadcast of the same bytes")
    p.add_argument("--size-mib", type=float, default=None,
                   help="payload (default: 1024 with 2 GPUs, else 64)")
    p.add_argument("--bucket-mib", type=float, default=None,
                   help="bucket size (default: 512 with 2 GPUs, else 16)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (median reported)")
    p.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"],
                   help="auto: nccl between GPU 0 and 1 when there are 2, else gloo on CPU")
    p.add_argument("--timeout", type=float, default=120.0, help="every wait of the transfer")
    p.add_argument("--deadline", type=float, default=600.0, help="the whole benchmark")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="show the last push's progress on stderr")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="push a LoRA adapter of this rank on every matrix instead of the model")
    p.add_argument("--json", default="", help="write the results here ('-': stdout)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("verify", help="compare a safetensors checkpoint with an engine's weights")
    p.add_argument("--checkpoint", required=True, help="directory (or file) of *.safetensors")
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="a vllm serve with VLLM_SERVER_DEV_MODE=1 and vllm_nccl_sync.Ext")
    p.add_argument("--workers", type=int, default=1, help="workers of that server (TP x PP)")
    p.add_argument("--names", default="", help="comma-separated vLLM parameter names (default all)")
    p.add_argument("--show", default="problems", choices=["problems", "all", "none"])
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", default="", help="write the full report here ('-': stdout)")
    p.set_defaults(func=cmd_verify)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from vllm_nccl_sync.engine.metrics import configure_logging

    configure_logging(json_lines=args.log_json, level=getattr(logging, args.log_level.upper()))
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a clear one-line error, the traceback at DEBUG
        logging.getLogger("vllm_nccl_sync.cli").debug("failed", exc_info=True)
        print(f"vllm-nccl-sync {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
