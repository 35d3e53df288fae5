"""Receiving beside serving: the update lands in a shadow copy, then a short swap loads it.

`EngineSession.receive_beside` starts one update's receive on a thread of its own and returns at
once, so the engine goes on scheduling and running forward passes with the weights it holds.
The update must be staged (`push(..., staged=True)`): every bucket is received, checked and kept
in the `Shadow`; after the commit round's first phase (every worker of every engine verified
everything) the receive waits at the gate. `EngineSession.swap`, called by the engine's owner
with generation paused, opens the gate and waits: the shadow goes through the engine's own loader
(vLLM's `load_weights`, in place, storage and CUDA graphs kept, then the family's post-load rule),
the second phase commits, the version is stamped, and the call returns the update's summary.

A failure before the gate leaves the serving weights untouched (nothing was loaded anywhere); a
failure during the swap leaves the engine reporting inconsistent, as an in-place update does.

What the shadow holds: the update's tensors as they arrived (the trainer's names, dtypes and full
shapes; shard to shard, only the blocks this worker reads of a tensor it reads some of, made
whole in batches during the swap: `packing.wholes`), on the engine's device (`place="device"`)
or in host memory (`"host"`: pinned on a GPU engine, so the swap is host-to-device copies). One
arena, sized from the plan and kept between updates; a streamed update (no tensor list in its
plan) takes one allocation per tensor. A tensor larger than a bucket is copied in chunk by chunk
as its rows arrive.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator

import torch

from vllm_nccl_sync.outcomes import Kind, Problem, UpdateFailed, WorkerSummary

log = logging.getLogger(__name__)

PLACES = ("device", "host")
_ALIGN = 64


def available_bytes(device: torch.device, place: str) -> int:
    """Memory a shadow on `place` of an engine on `device` may take now."""
    if place == "device" and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024


class Shadow:
    """Where a receive beside serving keeps the update until the swap (see the module).

    `available` (tests) replaces `available_bytes` as the measure of free memory.
    """

    def __init__(self, device: torch.device, place: str = "device",
                 available: Callable[[torch.device, str], int] = available_bytes) -> None:
        if place not in PLACES:
            raise ValueError(f"shadow place {place!r} must be one of {PLACES}")
        self.device = torch.device(device)
        self.place = place
        self.target = self.device if place == "device" else torch.device("cpu")
        self._pin = place == "host" and self.device.type == "cuda"
        self._available = available
        self._arena: torch.Tensor | None = None
        self._used = 0
        self.kept = 0
        """Bytes the update in progress (or the last one) kept here."""
        self._open: dict[str, torch.Tensor] = {}
        self.completed: list[tuple[str, torch.Tensor]] = []
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @property
    def nbytes(self) -> int:
        """Bytes the arena holds (kept between updates)."""
        return 0 if self._arena is None else self._arena.numel()

    def where(self) -> str:
        return f"{'pinned host memory' if self._pin else 'host memory'}" if self.place == "host" \
            else str(self.device)

    def reserve(self, nbytes: int) -> Problem | None:
        """Begin an update: hold an arena of at least `nbytes`; why not (None if it fits)."""
        self._used, self.kept, self._open, self.completed = 0, 0, {}, []
        need = nbytes + _ALIGN * 4096
        if self.nbytes >= nbytes:
            return None
        free = self._available(self.device, self.place) + self.nbytes
        if need > free:
            return Problem(Kind.SHADOW, f"receiving beside serving keeps a shadow copy of the "
                           f"update ({nbytes / 1e9:.2f} GB) in {self.where()}, where "
                           f"{free / 1e9:.2f} GB is free; receive with generation paused, or "
                           "keep the shadow in host memory (shadow='host')")
        self._arena = None
        self._arena = torch.empty(need, dtype=torch.uint8, device=self.target,
                                  pin_memory=self._pin)
        return None

    def _take(self, dtype: torch.dtype, shape: list[int] | torch.Size) -> torch.Tensor:
        """Room for one tensor: in the arena while it lasts, else an allocation of its own."""
        n = math.prod(shape) * dtype.itemsize
        self.kept += n
        arena = self._arena
        if arena is not None and self._used + n <= arena.numel():
            out = arena[self._used:self._used + n].view(dtype).view(shape)
            self._used += -(-n // _ALIGN) * _ALIGN
            return out
        return torch.empty(shape, dtype=dtype, device=self.target, pin_memory=self._pin)

    def keep(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of `t` in the shadow (done when this returns: `t`'s buffer may be reused)."""
        out = self._take(t.dtype, t.shape)
        out.copy_(t)
        return out

    def load_rows(self, name: str, rows: torch.Tensor, first_row: int, shape: list[int]) -> bool:
        """A tensor larger than a bucket, copied into the shadow chunk by chunk straight from
        the bucket buffer (`packing.RowLoader`): never reassembled in a host staging copy, whose
        one large pageable copy to the device would hold up the engine's own CUDA calls. Once
        its last rows arrived it is in `completed`."""
        if first_row == 0:
            self._open[name] = self._take(rows.dtype, shape)
        dst = self._open.get(name)
        if dst is None:
            return False
        dst[first_row:first_row + rows.shape[0]].copy_(rows)
        if first_row + rows.shape[0] == shape[0]:
            self.completed.append((name, self._open.pop(name)))
        return True

    def take_completed(self) -> list[tuple[str, torch.Tensor]]:
        done, self.completed = self.completed, []
        return done

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """The receive thread's CUDA device and a stream of its own, beside the engine's."""
        if self._stream is None:
            yield
            return
        torch.cuda.set_device(self.device)
        with torch.cuda.stream(self._stream):
            yield
        self._stream.synchronize()

    def quiesce(self) -> None:
        """Every kernel queued on the engine's device so far has run. The swap's copies run on
        this shadow's own stream, while a step of the engine may still be executing (vLLM's
        asynchronous scheduling takes the swap call with a batch in flight): without this, that
        step could read weights half swapped."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def settle(self) -> None:
        """Every copy this thread queued ran (before the swap's caller goes on)."""
        if self._stream is not None:
            self._stream.synchronize()

    def release(self) -> None:
        self._arena = None


class BesideReceive:
    """One update received beside serving, on a daemon thread (see the module).

    `run(shadow)` receives the update (the receiver's `run` with `shadow`); `stage` is what
    `report` shows: `receiving`, `ready` (verified everywhere, waiting for the swap), `swapping`,
    `done`.
    """

    def __init__(self, run: Callable[[BesideReceive], WorkerSummary], shadow: Shadow,
                 gate_s: float) -> None:
        self.shadow = shadow
        self.stage = "receiving"
        self._gate_s = gate_s
        self._go = threading.Event()
        self._cancelled = False
        self._done = threading.Event()
        self._queued = threading.Event()
        """The swap's loads were queued (the device may still copy), or the receive ended."""
        self.summary: WorkerSummary | None = None
        self.marks: dict[str, float] = {"start": time.perf_counter()}
        """When each step of the receive was reached (`perf_counter`), reported with the
        summary as `beside` together with the garbage collections that ran meanwhile."""
        self._gcs: list[list[float]] = []
        self._gc_t0 = 0.0
        self._thread = threading.Thread(target=self._main, args=(run,), daemon=True,
                                        name="nccl-sync-beside")
        self._thread.start()

    def mark(self, what: str) -> None:
        self.marks[what] = time.perf_counter()

    def _gc(self, phase: str, info: dict) -> None:
        """Every garbage collection of the process while the receive runs (they stop every
        thread, the engine's included): [start, seconds, generation]."""
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif len(self._gcs) < 200:
            self._gcs.append([self._gc_t0, time.perf_counter() - self._gc_t0,
                              info.get("generation", -1)])

    def _main(self, run: Callable[[BesideReceive], WorkerSummary]) -> None:
        gc.callbacks.append(self._gc)
        try:
            with torch.no_grad(), self.shadow.context():
                self.summary = run(self)
        except BaseException as e:  # noqa: BLE001 - reported in the summary, never raised
            log.exception("receiving beside serving failed")
            self.summary = WorkerSummary(ok=False, rank=-1, error=f"receive thread: {e!r}")
        finally:
            gc.callbacks.remove(self._gc)
            self.mark("end")
            self.summary.extra["beside"] = {"marks": self.marks, "gc": self._gcs}
            self.stage = "done"
            self._done.set()
            self._queued.set()

    def gate(self, version: int) -> None:
        """Called by the receive once the update verified everywhere: wait for `swap`."""
        self.shadow.settle()
        self.mark("verified")
        self.stage = "ready"
        if not self._go.wait(self._gate_s) or self._cancelled:
            why = "the receive was cancelled" if self._cancelled else \
                f"no swap was asked within {self._gate_s:.0f} s"
            raise UpdateFailed(f"update {version} verified, but {why}; nothing was loaded here")
        self.mark("swap")
        self.stage = "swapping"

    @property
    def running(self) -> bool:
        return not self._done.is_set()

    def queued(self) -> None:
        """Called by the swap once its loads are queued and the post-load rule returned."""
        self._queued.set()

    def _open_gate(self) -> None:
        if not self._go.is_set():
            self.shadow.quiesce()
            self._go.set()

    def open(self, timeout_s: float) -> None:
        """Open the gate and wait (at most `timeout_s`) until the swap's loads are queued or
        the receive ended. Called by the engine between two steps, which may do its own work
        of that turn while the device copies; `swap` then waits for the end (and reports a
        receive that never got that far)."""
        self._open_gate()
        self._queued.wait(timeout_s)

    def swap(self, timeout_s: float) -> WorkerSummary:
        """Open the gate (unless `open` did) and wait (at most `timeout_s`) for the update's
        end; its summary. Called by the engine between two steps (an RPC), on its thread."""
        self._open_gate()
        if not self._done.wait(timeout_s):
            return WorkerSummary(ok=False, rank=-1, error=(
                f"the receive beside serving did not end within {timeout_s:.0f} s of the swap "
                f"(it was {self.stage})"))
        assert self.summary is not None
        return self.summary

    def cancel(self, timeout_s: float) -> None:
        """Let the receive end without loading (it still ends its waits by their bounds)."""
        self._cancelled = True
        self._go.set()
        self._done.wait(timeout_s)
