"""Fault matrix on a real vLLM engine: an update never hangs and never takes the engine down.

    python benchmarks/fault_matrix.py --gpu --out $OUT        # 2 GPUs, NCCL (the real target)
    python benchmarks/fault_matrix.py --cpu --out out/fm      # smoke: vLLM CPU build, gloo

Every scenario runs its own processes, each in its own process group and logging to its own file
in `--out`: a vLLM engine (`vllm.LLM`, worker extension `vllm_nccl_sync.Ext`, the default
multiprocess engine core; with `--gpu` on cuda:1 with torch.compile and CUDA graphs) and a trainer
(`PushClient`; with `--gpu` on cuda:0). This orchestrator drives them over socket pairs; every
wait is bounded, and every process started is asked to exit, then its process group SIGKILLed.
Scenarios run concurrently (`--parallel`: all with `--gpu`, one at a time with `--cpu`). The model
is `vllm_nccl_sync.tiny`'s tiny fp32 qwen2 in 64 KiB buckets (~26); transformers' greedy output
is computed on CPU in fp32, as in tests/gpu/test_gpu_vllm.py. With `--gpu` the first engine starts
alone (its torch.compile cache then serves the others), and each engine takes
gpu_memory_utilization 0.08 with a fixed 256 MiB KV cache (KV memory profiling breaks when
engines start side by side on one GPU). Each scenario first pushes a good version 1, then version
2 with a fault:

  a  the trainer SIGKILLs itself inside its tensor generator, after ~3 buckets  (in place, staged)
  b  the trainer SIGKILLs itself right after posting bucket 3's collective     (in place, staged)
  c  the trainer SIGKILLs itself right after posting the last collective       (in place, staged)
  d  the engine's process group is SIGKILLed once the trainer sent 2 buckets   (in place)

a-c check that the engine's `nccl_sync_receive` returns within 2 * timeout_s + 10 s with ok False,
that `nccl_sync_state()` holds version 1, consistent for staged (and its greedy output is still
version 1's) and inconsistent in place; that the engine keeps serving greedy `generate` calls for
`--alive-s` after the fault (past NCCL's watchdog timeout); and that it then re-joins a new trainer
process whose full push of version 3 succeeds, after which the engine's greedy output equals
transformers' with those weights. In c the last bytes may land before the trainer dies; the update
then legitimately completes (ok, version 2, consistent, version 2's output), which also passes.
d checks that the trainer's push fails within the same bound after the kill, that the trainer
process stays healthy for `--alive-s`, and that it then serves a freshly started engine (full push,
output equal to transformers').

Writes `fault_matrix.json` and `fault_matrix.md` to `--out`; exit code 0 iff every scenario passed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MAX_TOKENS = 8
SEEDS = {0: 1, 1: 2, 2: 3, 3: 4}
"""Weight seed of each version: 0 is the checkpoint the engine starts from, 2 the faulty update."""


class ChildDied(RuntimeError):
    """A role process exited (or closed its end of the socket pair)."""


# --------------------------------------------------------------------------- role processes


def _send(conn: Connection, **msg: Any) -> None:
    conn.send(msg)


def _die(conn: Connection, where: str) -> None:
    """Tell the orchestrator when and where, then SIGKILL this process."""
    _send(conn, event="fault", t=time.monotonic(), where=where)
    os.kill(os.getpid(), signal.SIGKILL)


def _serve(conn: Connection, handlers: dict[str, Callable[..., dict]]) -> None:
    """Answer commands `{"cmd": name, **kwargs}` with `{"reply": name, **result}` until `exit`."""
    while True:
        msg = conn.recv()
        cmd = msg.pop("cmd")
        if cmd == "exit":
            _send(conn, reply=cmd)
            return
        try:
            result = handlers[cmd](**msg)
        except Exception as e:
            traceback.print_exc()
            result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        _send(conn, reply=cmd, **result)


def engine_role(conn: Connection, spec: dict) -> None:
    """A vLLM engine with the extension; commands: join, receive, state, generate, exit."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import TokensPrompt

    from vllm_nccl_sync.tiny import PROMPTS, engine_kwargs

    kw = engine_kwargs(worker_extension_cls="vllm_nccl_sync.Ext", **spec["llm"])
    if spec["kv_cache_bytes"] and "kv_cache_memory_bytes" in {
        f.name for f in dataclasses.fields(EngineArgs)
    }:  # no KV-cache memory profiling: it fails when engines start side by side on one GPU
        kw["kv_cache_memory_bytes"] = spec["kv_cache_bytes"]
    t0 = time.monotonic()
    llm = LLM(model=spec["model"], **kw)
    _send(conn, event="ready", startup_s=round(time.monotonic() - t0, 1), vllm=vllm.__version__,
          llm={k: v for k, v in kw.items() if k != "worker_extension_cls"})
    rpc_s = spec["rpc_timeout_s"]
    sampling = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def join(cfg: dict) -> dict:
        return {"ok": True, "join": llm.collective_rpc("nccl_sync_join", timeout=rpc_s,
                                                       args=(cfg, 1))[0]}

    def receive(timeout_s: float) -> dict:
        t = time.monotonic()
        [summary] = llm.collective_rpc("nccl_sync_receive", timeout=rpc_s, args=(timeout_s,))
        t_end = time.monotonic()
        llm.reset_prefix_cache()  # its KV came from the old weights
        return {"ok": True, "summary": summary, "seconds": t_end - t, "t_end": t_end}

    def state() -> dict:
        return {"ok": True, "state": llm.collective_rpc("nccl_sync_state", timeout=60)[0]}

    def generate() -> dict:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], sampling,
                            use_tqdm=False)
        return {"ok": True, "tokens": [list(o.outputs[0].token_ids) for o in outs]}

    _serve(conn, {"join": join, "receive": receive, "state": state, "generate": generate})


def _dying_stream(tensors: dict, kill_after_bytes: int, conn: Connection) -> Iterator[tuple]:
    """`tensors` as a generator that SIGKILLs the process once `kill_after_bytes` were yielded."""
    sent = 0
    for name, t in tensors.items():
        if sent >= kill_after_bytes:
            time.sleep(1.0)  # the buckets already posted land on the engine: between buckets
            _die(conn, f"generator, after {sent} bytes")
        sent += t.numel() * t.element_size()
        yield name, t


def _kill_at_broadcast(n: int, conn: Connection) -> None:
    """Make this process SIGKILL itself right after posting its `n`-th broadcast from now."""
    from vllm_nccl_sync.planes.base import Transport

    real, calls = Transport.broadcast, [0]

    def broadcast(self, tensor, src=0, *, length=None, to=None):
        work = real(self, tensor, src, length=length, to=to)
        calls[0] += 1
        if calls[0] == n:
            _die(conn, f"after posting broadcast {n}")
        return work

    Transport.broadcast = broadcast


def trainer_role(conn: Connection, spec: dict) -> None:
    """A trainer; commands: connect, push, ping, exit. Weights are `build_model(arch, seed)`."""
    import torch

    from vllm_nccl_sync import PushClient, SyncConfig
    from vllm_nccl_sync.tiny import build_model

    dev = torch.device("cuda", 0) if spec["gpu"] else torch.device("cpu")
    if spec["gpu"]:
        torch.cuda.set_device(dev)
    client: PushClient | None = None
    _send(conn, event="ready")

    def connect(cfg: dict) -> dict:
        nonlocal client
        if client is not None:
            client.close()
        client = PushClient(SyncConfig(**cfg), device=dev if spec["gpu"] else None)
        client.connect()
        return {"ok": True}

    def push(seed: int, version: int, staged: bool = False, full: bool = False,
             fault: str = "", kill_at: int = 0, pause_at: int = 0) -> dict:
        """One push; `fault`: "generator" (die after `kill_at` bytes), "broadcast" (die after
        the `kill_at`-th collective); `pause_at`: after that bucket, wait for `continue`."""
        tensors = {n: t.to(dev) for n, t in build_model(spec["arch"], seed).state_dict().items()}
        items: Any = tensors
        if fault == "generator":
            items = _dying_stream(tensors, kill_at, conn)
        elif fault == "broadcast":
            _kill_at_broadcast(kill_at, conn)
        resumed = [0.0]

        def progress(buckets: int, nbytes: int, seconds: float) -> None:
            if buckets == pause_at:
                _send(conn, event="progress", buckets=buckets, bytes=nbytes)
                if not conn.poll(spec["pause_max_s"]):
                    raise TimeoutError("no 'continue' from the orchestrator")
                conn.recv()
                resumed[0] = time.monotonic()

        t0 = time.monotonic()
        try:
            r = client.push(items, version=version, staged=staged, full=full,
                            progress=progress if pause_at else None)
            out = {"ok": True, "buckets": r.buckets, "bytes": r.bytes}
        except Exception as e:
            traceback.print_exc()
            out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        t_end = time.monotonic()
        out.update(seconds=t_end - t0, after_resume_s=t_end - resumed[0] if resumed[0] else None)
        return out

    def ping() -> dict:
        if spec["gpu"]:  # the CUDA context still works
            torch.ones(1, device=dev).add_(1).item()
        return {"ok": True}

    _serve(conn, {"connect": connect, "push": push, "ping": ping})


# --------------------------------------------------------------------------- orchestrator


@dataclasses.dataclass(frozen=True)
class Settings:
    """The run's parameters (see `main` for their meaning and defaults)."""

    gpu: bool
    out: Path
    alive_s: float
    every_s: float
    timeout_s: float
    bucket_bytes: int
    parallel: int
    gpu_mem: float
    kv_cache_bytes: int
    arch: str
    start_s: float
    deadline_s: float

    @property
    def bound_s(self) -> float:
        """An update must end within this after its fault."""
        return 2 * self.timeout_s + 10

    @property
    def hard_s(self) -> float:
        """Any single command taking longer counts as a hang."""
        return 4 * self.timeout_s + 60


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One row of the matrix; its first letter is the kind of fault."""

    name: str
    fault: str
    staged: bool = False

    @property
    def kind(self) -> str:
        return self.name[0]


SCENARIOS = [
    Scenario("d", "engine process group SIGKILLed after 2 buckets"),
    *(Scenario(f"{k}-{m}", text, m == "staged")
      for k, text in (("a", "trainer SIGKILLed between buckets (in its generator)"),
                      ("b", "trainer SIGKILLed right after posting bucket 3's collective"),
                      ("c", "trainer SIGKILLed right after posting the last collective"))
      for m in ("inplace", "staged")),
]


class Child:
    """A role process in its own process group, spoken to over a socket pair."""

    def __init__(self, name: str, role: str, spec: dict, out: Path, env: dict[str, str]) -> None:
        self.name = name
        ours, theirs = socket.socketpair()
        spec_path = out / f"{name}.spec.json"
        spec_path.write_text(json.dumps(spec, indent=1))
        with open(out / f"{name}.log", "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--role", role,
                 "--fd", str(theirs.fileno()), "--spec", str(spec_path)],
                stdout=log, stderr=subprocess.STDOUT, env=env, pass_fds=(theirs.fileno(),),
                start_new_session=True)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.events: list[dict] = []
        self.info: dict | None = None

    def send(self, cmd: str, **kw: Any) -> None:
        self.conn.send({"cmd": cmd, **kw})

    def _next(self, end: float) -> dict:
        while not self.conn.poll(0.2):
            if self.proc.poll() is not None and not self.conn.poll(0):
                raise ChildDied(f"{self.name} exited with code {self.proc.returncode}")
            if time.monotonic() > end:
                raise TimeoutError(f"{self.name}: no answer within the bound")
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
            raise ChildDied(f"{self.name} closed its connection (exit code "
                            f"{self.proc.returncode})") from None

    def wait_for(self, match: Callable[[dict], bool], timeout_s: float) -> dict:
        """The next message that `match`es; the others are kept in `events`."""
        for i, msg in enumerate(self.events):
            if match(msg):
                return self.events.pop(i)
        end = time.monotonic() + timeout_s
        while not match(msg := self._next(end)):
            self.events.append(msg)
        return msg

    def reply(self, cmd: str, timeout_s: float) -> dict:
        msg = self.wait_for(lambda m: m.get("reply") == cmd, timeout_s)
        return {k: v for k, v in msg.items() if k != "reply"}

    def call(self, cmd: str, timeout_s: float, **kw: Any) -> dict:
        self.send(cmd, **kw)
        return self.reply(cmd, timeout_s)

    def ready(self, timeout_s: float) -> dict:
        if self.info is None:
            self.info = self.wait_for(lambda m: m.get("event") == "ready", timeout_s)
        return self.info

    def event(self, name: str) -> dict | None:
        return next((m for m in self.events if m.get("event") == name), None)

    def stop(self) -> None:
        """Ask the process to exit, then SIGKILL its process group (engine core and all)."""
        if self.proc.poll() is None:
            try:
                self.send("exit")
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        self.conn.close()


class Run:
    """What the scenarios share: settings, expected outputs, ports, and every child started."""

    def __init__(self, s: Settings, model_path: str, expected: dict[int, list]) -> None:
        self.s = s
        self.model_path = model_path
        self.expected = expected
        self.children: list[Child] = []
        self.lock = threading.Lock()
        self._ports: set[int] = set()
        self._first_engine = True
        self.warm = threading.Event()
        """Set once the first engine is up (its torch.compile cache then serves the others)."""
        if not s.gpu:
            self.warm.set()

    def _env(self, cuda: str) -> dict[str, str]:
        env = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_ENABLE_V1_MULTIPROCESSING="1",
                   PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        env.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast (shared hosts)
        if self.s.gpu:
            env["CUDA_VISIBLE_DEVICES"] = cuda
        return env

    def _child(self, name: str, role: str, spec: dict, cuda: str) -> Child:
        child = Child(name, role, spec, self.s.out, self._env(cuda))
        with self.lock:
            self.children.append(child)
        return child

    def trainer(self, name: str) -> Child:
        spec = {"gpu": self.s.gpu, "arch": self.s.arch, "pause_max_s": self.s.hard_s}
        return self._child(name, "trainer", spec, "0")

    def engine(self, name: str) -> Child:
        """Start an engine; on GPU the first one starts alone and the others wait for it."""
        llm: dict[str, Any] = {"max_num_seqs": 8}
        if self.s.gpu:
            llm.update(enforce_eager=False, gpu_memory_utilization=self.s.gpu_mem)
        spec = {"model": self.model_path, "llm": llm, "rpc_timeout_s": self.s.hard_s,
                "kv_cache_bytes": self.s.kv_cache_bytes if self.s.gpu else 0}
        with self.lock:
            first, self._first_engine = self._first_engine, False
        if not first and not self.warm.wait(self.s.start_s):
            raise TimeoutError("the first engine did not start")
        child = self._child(name, "engine", spec, "1")
        if first:
            try:
                child.ready(self.s.start_s)
            finally:
                self.warm.set()
        return child

    def cfg(self) -> dict:
        """A fresh SyncConfig (as a dict) with ports no other scenario got."""
        from vllm_nccl_sync.trainer.sync import free_port

        with self.lock:
            ports = []
            while len(ports) < 2:
                p = free_port()
                if p not in self._ports:
                    self._ports.add(p)
                    ports.append(p)
        return {"control_port": ports[0], "group_port": ports[1], "world_size": 2,
                "backend": "nccl" if self.s.gpu else "gloo", "bucket_bytes": self.s.bucket_bytes,
                "timeout_s": self.s.timeout_s}

    def join(self, eng: Child, tr: Child) -> None:
        cfg = self.cfg()
        tr.send("connect", cfg=cfg)
        eng.send("join", cfg=cfg)
        for who, cmd in ((eng, "join"), (tr, "connect")):
            r = who.reply(cmd, self.s.hard_s)
            if not r["ok"]:
                raise RuntimeError(f"{who.name} {cmd} failed: {r['error']}")

    def update(self, eng: Child, tr: Child, version: int, **kw: Any) -> tuple[dict, dict]:
        """Engine receive + trainer push of `version`; returns (engine reply, trainer reply),
        the latter `{}` if the trainer died."""
        eng.send("receive", timeout_s=self.s.timeout_s)
        tr.send("push", seed=SEEDS[version], version=version, **kw)
        rec = eng.reply("receive", self.s.hard_s)
        try:
            return rec, tr.reply("push", self.s.hard_s)
        except ChildDied:
            return rec, {}

    def good_update(self, eng: Child, tr: Child, version: int, res: dict, key: str,
                    **kw: Any) -> None:
        """A push that must succeed: records it, checks the engine's state and output."""
        rec, push = self.update(eng, tr, version, **kw)
        summary, state = rec.get("summary") or {}, engine_state(eng)
        gen = eng.call("generate", self.s.hard_s)
        res[key] = {"summary": summary, "push": push, "state": state,
                    "error": rec.get("error") or summary.get("error") or push.get("error")}
        res["checks"][f"{key}: push ok"] = bool(
            push.get("ok") and summary.get("ok") and state["version"] == version
            and state["consistent"])
        res["checks"][f"{key}: output == transformers"] = (
            gen.get("tokens") == self.expected[version])

    def serve_for(self, t_fault: float, probe: Callable[[], dict]) -> dict:
        """Call `probe` every `every_s` until `alive_s` after `t_fault` (the last call after it);
        stops at the first failure."""
        end = t_fault + self.s.alive_s
        calls: list[dict] = []
        while True:
            last = time.monotonic() >= end
            t = time.monotonic()
            try:
                r = probe()
            except (ChildDied, TimeoutError) as e:
                r = {"ok": False, "error": str(e)}
            calls.append({"at_s": round(t - t_fault, 1), "ok": bool(r.get("ok")),
                          **({"error": r["error"]} if r.get("error") else {})})
            if last or not r.get("ok"):
                break
            time.sleep(max(min(self.s.every_s, end - time.monotonic()), 0))
        ok = all(c["ok"] for c in calls)
        return {"calls": calls, "ok": ok, "n_ok": sum(c["ok"] for c in calls),
                "covered_s": calls[-1]["at_s"] if ok else 0.0}


def engine_state(eng: Child) -> dict:
    r = eng.call("state", 60)
    if not r["ok"]:
        raise RuntimeError(f"{eng.name} nccl_sync_state failed: {r['error']}")
    return r["state"]


def start_pair(run: Run, sc: Scenario, res: dict) -> tuple[Child, Child]:
    """The scenario's trainer and engine, joined, after a good update to version 1."""
    tr = run.trainer(f"{sc.name}.trainer")
    eng = run.engine(f"{sc.name}.engine")
    tr.ready(run.s.start_s)
    res["engine_startup_s"] = eng.ready(run.s.start_s)["startup_s"]
    run.join(eng, tr)
    run.good_update(eng, tr, 1, res, "v1")
    return tr, eng


def kill_trainer_scenario(run: Run, sc: Scenario, res: dict) -> None:
    """a, b, c: the trainer dies mid-update; the engine must survive and re-join a new trainer."""
    s, checks = run.s, res["checks"]
    tr, eng = start_pair(run, sc, res)
    buckets = res["v1"]["push"].get("buckets") or 0
    if buckets <= 3:
        raise RuntimeError(f"version 1 took {buckets} buckets; the faults need more than 3")
    fault: dict[str, Any] = {
        "a": {"fault": "generator", "kill_at": 3 * s.bucket_bytes},
        "b": {"fault": "broadcast", "kill_at": 3},
        "c": {"fault": "broadcast", "kill_at": buckets},
    }[sc.kind]
    rec, push = run.update(eng, tr, 2, staged=sc.staged, **fault)
    died = tr.event("fault")
    summary = rec.get("summary") or {}
    res.update(summary=summary, receive_s=rec.get("seconds"), trainer_push=push,
               trainer_exit=tr.proc.poll(), fault_event=died,
               error=summary.get("error") or rec.get("error") or "")
    checks["fault injected (trainer SIGKILLed)"] = (
        died is not None and not push and tr.proc.returncode == -signal.SIGKILL)
    t_fault = died["t"] if died else time.monotonic()
    if rec.get("t_end"):
        res["after_fault_s"] = rec["t_end"] - t_fault
    checks[f"receive returned within {s.bound_s:.0f} s"] = (
        rec.get("seconds") is not None and rec["seconds"] <= s.bound_s)
    completed = bool(summary.get("ok"))
    res["outcome"] = "completed" if completed else "failed"
    # A complete update is legitimate only when the last bytes landed before the trainer died (c).
    checks["receive ok False (in c: or complete)"] = not completed or sc.kind == "c"
    if completed:
        version, consistent, want = 2, True, run.expected[2]
    else:
        version, consistent = 1, sc.staged
        want = run.expected[1] if sc.staged else None
    tr2 = run.trainer(f"{sc.name}.trainer2")  # imports while the engine is watched
    res["state"] = state = engine_state(eng)
    checks[f"state: version {version}, consistent {consistent}"] = (
        state["version"] == version and state["consistent"] == consistent)

    def probe() -> dict:
        r = eng.call("generate", s.hard_s)
        if r["ok"] and want is not None and r["tokens"] != want:
            return {"ok": False, "error": f"output is not version {version}'s"}
        return r

    res["alive"] = alive = run.serve_for(t_fault, probe)
    intact = f" with version {version}'s output" if want is not None else ""
    checks[f"engine served for {s.alive_s:.0f} s after the fault{intact}"] = (
        alive["ok"] and eng.proc.poll() is None)
    tr2.ready(s.start_s)
    run.join(eng, tr2)
    run.good_update(eng, tr2, 3, res, "v3", full=True)


def kill_engine_scenario(run: Run, sc: Scenario, res: dict) -> None:
    """d: the engine dies mid-update; the trainer's push must fail in bounds, and the same trainer
    process must then serve a new engine."""
    s, checks = run.s, res["checks"]
    tr, eng = start_pair(run, sc, res)
    eng.send("receive", timeout_s=s.timeout_s)
    tr.send("push", seed=SEEDS[2], version=2, pause_at=2)
    msg = tr.wait_for(lambda m: m.get("event") == "progress" or m.get("reply") == "push",
                      s.hard_s)
    if "reply" in msg:
        raise RuntimeError(f"the push ended before its second bucket: {msg}")
    res["fault_event"] = msg
    eng.kill()
    t_fault = time.monotonic()
    tr.send("continue")
    push = tr.reply("push", s.hard_s)
    res.update(trainer_push=push, receive_s=push.get("after_resume_s"),
               error=push.get("error", ""), outcome="completed" if push["ok"] else "failed")
    checks["push failed"] = not push["ok"]
    checks[f"push returned within {s.bound_s:.0f} s"] = (
        push.get("after_resume_s") is not None and push["after_resume_s"] <= s.bound_s)
    eng2 = run.engine(f"{sc.name}.engine2")  # starts while the trainer is watched
    res["alive"] = alive = run.serve_for(t_fault, lambda: tr.call("ping", s.hard_s))
    checks[f"trainer healthy for {s.alive_s:.0f} s after the fault"] = (
        alive["ok"] and tr.proc.poll() is None)
    eng2.ready(s.start_s)
    run.join(eng2, tr)
    run.good_update(eng2, tr, 3, res, "v3", full=True)


def run_scenario(run: Run, sc: Scenario) -> dict:
    res: dict[str, Any] = {"name": sc.name, "fault": sc.fault,
                           "mode": "staged" if sc.staged else "in place", "checks": {}}
    t0 = time.monotonic()
    print(f"[{sc.name}] start", flush=True)
    try:
        (kill_engine_scenario if sc.kind == "d" else kill_trainer_scenario)(run, sc, res)
    except Exception as e:
        res["exception"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
    finally:
        with run.lock:
            mine = [c for c in run.children if c.name.startswith(sc.name + ".")]
        for c in mine:
            c.stop()
    res["seconds"] = round(time.monotonic() - t0, 1)
    res["passed"] = bool(res["checks"]) and all(res["checks"].values()) and "exception" not in res
    failed = [k for k, v in res["checks"].items() if not v]
    print(f"[{sc.name}] {'PASS' if res['passed'] else 'FAIL'} in {res['seconds']} s"
          + (f"; failed: {failed}" if failed else "")
          + (f"; {res['exception']}" if "exception" in res else ""), flush=True)
    return res


def machine() -> dict:
    import platform

    import torch

    info: dict[str, Any] = {"host": platform.node(), "python": platform.python_version(),
                            "torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return info


def _clip(text: Any, n: int = 300) -> str:
    text = " ".join(str(text or "").split()).replace("|", "/")
    return text if len(text) <= n else text[: n - 3] + "..."


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = [
        f"# Fault matrix ({'GPU, NCCL' if s['gpu'] else 'CPU, gloo'})", "",
        f"Command: `{report['command']}`  ",
        f"Machine: {json.dumps(report['machine'])}  ",
        f"timeout_s {s['timeout_s']}, bucket {s['bucket_bytes'] // 1024} KiB, "
        f"alive window {s['alive_s']} s; bound on an update's end after its fault: "
        f"{2 * s['timeout_s'] + 10} s. Result: **{'PASS' if report['passed'] else 'FAIL'}**", "",
        "| scenario | fault | mode | outcome | s to return (after fault) | ok | consistent "
        "| version | alive (calls ok) | re-join + full push | == transformers | pass | error |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["scenarios"]:
        st = r.get("state") or {}
        alive = r.get("alive") or {}
        secs = r.get("receive_s")
        after = f" ({r['after_fault_s']:.1f})" if "after_fault_s" in r else ""
        lines.append(" | ".join([
            f"| {r['name']}", r["fault"], r["mode"], r.get("outcome", "-"),
            f"{secs:.1f}{after}" if isinstance(secs, float) else "-",
            str((r.get("summary") or r.get("trainer_push") or {}).get("ok", "-")),
            str(st.get("consistent", "-")), str(st.get("version", "-")),
            f"{alive.get('covered_s', 0):.0f} s ({alive.get('n_ok', 0)}/"
            f"{len(alive.get('calls', []))})" if alive else "-",
            str(r["checks"].get("v3: push ok", "-")),
            str(r["checks"].get("v3: output == transformers", "-")),
            "PASS" if r["passed"] else "FAIL",
            _clip(r.get("exception") or r.get("error")) + " |",
        ]))
    failed = [(r["name"], k) for r in report["scenarios"] for k, v in r["checks"].items() if not v]
    if failed:
        lines += ["", "Failed checks: " + "; ".join(f"{n}: {k}" for n, k in failed)]
    return "\n".join(lines) + "\n"


def orchestrate(s: Settings, only: list[str]) -> int:
    from vllm_nccl_sync.tiny import PROMPTS, build_model, hf_greedy, make_model

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # processes NCCL aborts dump no cores
    s.out.mkdir(parents=True, exist_ok=True)
    model_path = make_model(str(s.out / "checkpoint"), s.arch, seed=SEEDS[0])
    expected = {v: hf_greedy(build_model(s.arch, SEEDS[v]), PROMPTS, MAX_TOKENS) for v in (1, 2, 3)}
    run = Run(s, model_path, expected)
    scenarios = [sc for sc in SCENARIOS if not only or sc.name in only or sc.kind in only]
    results: dict[str, dict] = {}
    pending = list(scenarios)
    threads: list[threading.Thread] = []
    end = time.monotonic() + s.deadline_s

    def worker() -> None:
        while True:
            with run.lock:
                if not pending:
                    return
                sc = pending.pop(0)
            results[sc.name] = run_scenario(run, sc)

    for _ in range(min(s.parallel, len(scenarios))):
        threads.append(threading.Thread(target=worker, daemon=True))
        threads[-1].start()
    for t in threads:
        t.join(max(end - time.monotonic(), 0))
    if any(t.is_alive() for t in threads):
        print(f"deadline of {s.deadline_s:.0f} s passed: killing everything", flush=True)
        with run.lock:
            pending.clear()
        for c in list(run.children):
            c.kill()
        for t in threads:
            t.join(60)
    for c in list(run.children):
        c.kill()
    first = next((c.info for c in run.children if c.info and "vllm" in c.info), {})
    report = {
        "command": shlex.join([os.path.basename(sys.executable), *sys.argv]),
        "machine": {**machine(), "vllm": first.get("vllm"), "engine": first.get("llm")},
        "settings": {**{k: v for k, v in vars(s).items() if k != "out"}, "out": str(s.out)},
        "scenarios": [results.get(sc.name, {"name": sc.name, "fault": sc.fault, "checks": {},
                                            "mode": "staged" if sc.staged else "in place",
                                            "passed": False, "exception": "did not finish"})
                      for sc in scenarios],
    }
    report["passed"] = all(r["passed"] for r in report["scenarios"])
    (s.out / "fault_matrix.json").write_text(json.dumps(report, indent=1, default=str))
    md = markdown(report)
    (s.out / "fault_matrix.md").write_text(md)
    print(md, flush=True)
    return 0 if report["passed"] else 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    target = ap.add_mutually_exclusive_group()
    target.add_argument("--gpu", action="store_true", help="engines on cuda:1, trainers on cuda:0")
    target.add_argument("--cpu", action="store_true", help="vLLM CPU build, gloo (smoke)")
    ap.add_argument("--out", default="out/fault_matrix", help="logs and results")
    ap.add_argument("--alive-s", type=float, help="watch after each fault (200 GPU, 30 CPU)")
    ap.add_argument("--every-s", type=float, help="between generate calls (15 GPU, 5 CPU)")
    ap.add_argument("--timeout-s", type=float, default=20.0, help="SyncConfig.timeout_s")
    ap.add_argument("--bucket-kib", type=int, default=64)
    ap.add_argument("--parallel", type=int, help="scenarios at once (all on GPU, 1 on CPU)")
    ap.add_argument("--gpu-mem", type=float, default=0.08, help="gpu_memory_utilization")
    ap.add_argument("--kv-cache-mib", type=int, default=256, help="per engine (GPU)")
    ap.add_argument("--arch", default="qwen2", choices=["qwen2", "llama"])
    ap.add_argument("--scenarios", default="", help="comma list of names or letters (all)")
    ap.add_argument("--start-s", type=float, default=420.0, help="bound on a process start")
    ap.add_argument("--deadline-s", type=float, help="whole run (540 GPU, 3600 CPU)")
    ap.add_argument("--role", choices=["engine", "trainer"], help=argparse.SUPPRESS)
    ap.add_argument("--fd", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role:
        conn = Connection(a.fd)
        spec = json.loads(Path(a.spec).read_text())
        (engine_role if a.role == "engine" else trainer_role)(conn, spec)
        sys.stdout.flush()
        os._exit(0)  # skip interpreter teardown (vLLM/NCCL atexit hooks can hang)
    if not (a.gpu or a.cpu):
        ap.error("choose --gpu or --cpu")
    gpu = a.gpu
    s = Settings(
        gpu=gpu, out=Path(a.out).resolve(),
        alive_s=a.alive_s if a.alive_s is not None else (200.0 if gpu else 30.0),
        every_s=a.every_s if a.every_s is not None else (15.0 if gpu else 5.0),
        timeout_s=a.timeout_s, bucket_bytes=a.bucket_kib * 1024,
        parallel=a.parallel or (len(SCENARIOS) if gpu else 1), gpu_mem=a.gpu_mem,
        kv_cache_bytes=a.kv_cache_mib << 20, arch=a.arch, start_s=a.start_s,
        deadline_s=a.deadline_s or (540.0 if gpu else 3600.0),
    )
    code = orchestrate(s, [x for x in a.scenarios.split(",") if x])
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
