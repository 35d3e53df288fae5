"""Replaying what a model's loader did: plain device copies instead of `load_weights`' Python.

vLLM's `load_weights` resolves, for every checkpoint tensor, where its bytes land (TP shard,
qkv/gate-up stacking, padding) through per-parameter Python loaders: for 171 tensors of a 7B model
that Python costs 15-20 ms around 4.5 ms of copies on an H200. The answer depends only on the
tensor's name, dtype, shape and the model's parameters, so it is recorded once and replayed.

Recording runs the loader under a `TorchDispatchMode` that sees every ATen op: a write into a
parameter's storage is recorded if it is a `copy_` straight from the tensor being loaded (any
view of it) or a constant `fill_`/`zero_`; any other write into a parameter (a computed value, a
dtype conversion made before the copy, a copy from another tensor than the one being loaded), or
a write into memory that is neither a parameter nor allocated by the loader during the recording,
switches replay off for the model, for good, with the reason kept (`off`). Each recorded entry
names its parameters and is replayed only while those are the very same `Parameter` objects on
the same storage, laid out alike (shape, strides, offset, storage size, dtype; for a parameter the
loader makes anew each update with the same constructor, as vLLM's CPU backend needs for its packed
linears, the layout alone), and the incoming tensor has the recorded dtype, shape and strides;
anything else goes through the loader again (and is recorded again).

A recording can also be made ahead, without touching the model (`rehearse`): the loader runs with
every write into a parameter skipped, so an update received beside serving is recorded while the
engine still serves and its swap replays from the first update on.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_nccl_sync.integrations.vllm.graphs import CapturedReplays
from vllm_nccl_sync.wire.cuda_sums import tables
from vllm_nccl_sync.wire.taps import Tap, copy_summed, fusable, tapping

log = logging.getLogger(__name__)
_aten = torch.ops.aten
_FILLS = {_aten.fill_.Scalar, _aten.zero_.default}


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


@dataclass(frozen=True, slots=True)
class _Op:
    """One write into parameter `param`'s storage: `copy_` from a view of the incoming tensor
    (`src`: element offset, size, stride within it), or a constant fill (`value`)."""

    param: str
    dst: tuple[int, tuple[int, ...], tuple[int, ...]]  # storage offset, size, stride
    src: tuple[int, tuple[int, ...], tuple[int, ...]] | None
    value: Any = None
    non_blocking: bool = False


@dataclass(slots=True)
class _Entry:
    signature: tuple[torch.dtype, tuple[int, ...], tuple[int, ...]]
    ops: list[_Op] = field(default_factory=list)
    params: dict[str, tuple] = field(default_factory=dict)
    """Every parameter it writes, as `_identity` knew it when recorded."""


def _identity(p: torch.Tensor, s: torch.UntypedStorage, renewed: bool) -> tuple:
    """What must not have changed for a recorded write into `p` to replay: its layout (shape,
    strides, offset in a storage of that size, dtype) and the very Parameter and storage; for a
    parameter its loader's `begin` makes anew each update with the same constructor
    (`renewed`), its layout only. `s`: its storage."""
    layout = (tuple(p.shape), p.stride(), p.storage_offset(), s.nbytes(), p.dtype)
    return ("renewed", *layout) if renewed else (id(p), s.data_ptr(), *layout)


def without_hooks() -> contextlib.AbstractContextManager:
    """Tensor subclasses' `__torch_function__` skipped: vLLM's parameters route every method
    and attribute through theirs (a Python call each, which only defers to torch's; about 6 µs
    per parameter where the replay's checks read its layout, against under 1 µs without). The
    ops a replay runs are ATen ops recorded below that level."""
    return torch._C.DisableTorchFunctionSubclass()


def _signature(t: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...], tuple[int, ...]]:
    return t.dtype, tuple(t.shape), tuple(t.stride())


_YIELD_S = 2e-4
"""How long `rehearse` sleeps between tensors: long enough for a thread waiting on the GIL to
wake and take it (about 34 ms over a 7B model's 171 tensors, spent beside serving)."""


class _Recorder(TorchDispatchMode):
    """Sees every ATen op while the loader runs (see the module)."""

    def __init__(self, plan: CopyPlan, dry: bool = False) -> None:
        super().__init__()
        self.plan = plan
        self.dry = dry
        """Skip every write into a parameter (`rehearse`)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            if not self.plan.off:
                self.plan._see(func, args, kwargs)
        except Exception as e:  # noqa: BLE001 - an op this cannot read: load, never replay
            self.plan._disable(f"{func} could not be recorded: {e!r}")
        if self.dry:  # a write into a parameter is recorded, never run (raises if unreadable)
            into = [a for a in _written_args(func, args, kwargs) if isinstance(a, torch.Tensor)
                    and a.numel() and _storage(a)[0] in self.plan._by_storage]
            if into:
                return into[0]
        out = func(*args, **kwargs)
        try:
            if not self.plan.off:
                self.plan._allocated(func, out)
        except Exception as e:  # noqa: BLE001
            self.plan._disable(f"{func}'s results could not be recorded: {e!r}")
        return out


class CopyPlan:
    """Per incoming tensor name, the copies its loading made; replayed where still valid."""

    def __init__(self) -> None:
        self.entries: dict[str, _Entry] = {}
        self.off = ""
        """Why replay is off for this model ("" while it is on)."""
        self.replayed = 0
        self.loaded = 0
        """Tensors that went through the loader itself (recorded, or replay off)."""
        self.graphs = CapturedReplays()
        """Batches that repeat, replayed as one CUDA graph launch each."""
        self._params: dict[str, torch.Tensor] = {}
        self._now: dict[str, tuple] = {}
        self._by_storage: dict[int, str] = {}
        self._current: tuple[str, torch.Tensor] | None = None
        self._recording: dict[str, _Entry] = {}
        self._fresh: set[int] = set()  # storages allocated while recording
        self._renewed: frozenset[str] = frozenset()

    def refresh(self, params: dict[str, torch.Tensor], renewed: frozenset[str] = frozenset()
                ) -> None:
        """The model's parameters and buffers as they are now (call once per update, after
        anything that may replace them). `renewed`: the parameters made anew for this update
        as the last one's were (the CPU backend's linears, `patches.cpu_repack`): their
        recorded writes replay into the new ones where the layout is the same, never as a
        captured graph (it holds the old addresses)."""
        self._params, self._renewed = params, renewed
        self._now = {}
        """What `_Entry.params` records of each parameter, as it is now."""
        self._by_storage = {}
        with without_hooks():
            for name, p in params.items():
                s = p.untyped_storage()
                self._now[name] = _identity(p, s, name in renewed)
                if p.numel():
                    self._by_storage.setdefault(s.data_ptr(), name)

    def load(self, batch: list[tuple[str, torch.Tensor]],
             load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], Iterable[str] | None]
             ) -> set[str]:
        """Load `batch`: replay what is known, run `load_weights` (recording) on the rest; the
        parameter names written."""
        known, rest = self.split(batch)
        done = self.replay(known)
        if rest:
            self.loaded += len(rest)
            with self.recording(rest) as weights:
                done |= set(load_weights(weights) or ())
        return done

    def _valid(self, name: str, t: torch.Tensor) -> _Entry | None:
        e = self.entries.get(name)
        if e is None or e.signature != _signature(t):
            return None
        now = self._now
        return e if all(now.get(p) == rec for p, rec in e.params.items()) else None

    def split(self, batch: list[tuple[str, torch.Tensor]]
              ) -> tuple[list[tuple[_Entry, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
        """The batch's tensors with a valid entry (to replay), and the rest (to load)."""
        if self.off:
            return [], batch
        known, rest = [], []
        for name, t in batch:
            e = self._valid(name, t)
            if e is None:
                rest.append((name, t))
            else:
                known.append((e, t))
        return known, rest

    @torch.no_grad()
    def replay(self, known: list[tuple[_Entry, torch.Tensor]]) -> set[str]:
        """Run the recorded writes; the parameter names written. On CUDA a batch whose writes
        repeat exactly is one captured graph launch once it was replayed before (`graphs`)."""
        if not known:
            return set()
        tap = tapping.get()
        device = known[0][1].device
        if (device.type == "cuda" and not self.graphs.off and not self._renewed
                and all(t.device == device for _, t in known)):
            key = (device.index, tap is not None,
                   *((id(e), t.data_ptr(), tap is not None and tap.wants(t)) for e, t in known))
            done, summed, count = self.graphs.run(
                key, device, lambda: self._queue(known, tap),
                lambda: [*tables(), *(e for e, _ in known)])
        else:
            done, summed, count = self._queue(known, tap)
        for t, terms in summed:
            tap.put(t, terms)
        self.replayed += count
        return set(done)  # a captured batch's set is handed out again

    def _queue(self, known: list[tuple[_Entry, torch.Tensor]], tap: Tap | None
               ) -> tuple[set[str], list[tuple[torch.Tensor, Any]], int]:
        """Queue the recorded writes (nothing else: this may be captured, see `replay`): the
        parameter names written, the checksum terms copies computed for `tap`, and how many
        tensors. One plain `copy_` per write: on an H200, 171 tensors of a 7B model took 4.6 ms
        on the device this way against 6.3 ms as one `_foreach_copy_` (its fused kernel copies
        slower than the copy engines), for about the same host time (1.3 against 1.15 ms).
        While a receiver taps what it reads (`taps.tapping`), the tensors it checksums
        that are copied whole into one parameter's slice go first, in one `copy_summed` launch
        that hands it their checksums: the sender's memory is read once."""
        done: set[str] = set()
        summed: list[tuple[torch.Tensor, Any]] = []
        with without_hooks():
            if tap is not None:
                known = self._summed(known, tap, done, summed)
            self._writes(known, done)
        return done, summed, len(known) + len(summed)

    def _writes(self, known: list[tuple[_Entry, torch.Tensor]], done: set[str]) -> None:
        """Queue the recorded writes of `known`, adding the parameter names written to `done`."""
        for e, t in known:
            base = t.storage_offset()  # recorded offsets are within t (contiguous)
            for op in e.ops:
                dst = self._params[op.param].as_strided(op.dst[1], op.dst[2], op.dst[0])
                if op.src is None:
                    dst.fill_(op.value)
                else:
                    dst.copy_(t.as_strided(op.src[1], op.src[2], base + op.src[0]),
                              non_blocking=op.non_blocking)
            done.update(e.params)

    def _summed(self, known: list[tuple[_Entry, torch.Tensor]], tap: Tap, done: set[str],
                summed: list[tuple[torch.Tensor, Any]]) -> list[tuple[_Entry, torch.Tensor]]:
        """Copy, summing, the entries that are one whole copy of a tensor `tap` wants into a
        parameter no other write of `known` touches (so running them first changes nothing),
        adding each tensor and its terms to `summed`; the entries left."""
        whole, rest = [], []
        for e, t in known:
            op = e.ops[0] if len(e.ops) == 1 else None
            dst = None
            if (op is not None and op.src == (0, tuple(t.shape), tuple(t.stride()))
                    and tap.wants(t)):
                dst = self._params[op.param].as_strided(op.dst[1], op.dst[2], op.dst[0])
            if dst is not None and fusable(dst, t):
                whole.append((e, t, dst))
            else:
                rest.append((e, t))
        others = {op.param for e, _ in rest for op in e.ops}
        keep = [(e, t, d) for e, t, d in whole if e.ops[0].param not in others]
        rest += [(e, t) for e, t, d in whole if e.ops[0].param in others]
        pairs = [(d.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
                 for _, t, d in keep]
        got = copy_summed(pairs) if keep else None
        if got is None:  # the kernel is not there: plain copies
            return rest + [(e, t) for e, t, _ in keep]
        for (e, t, _), terms in zip(keep, got, strict=True):
            summed.append((t, terms))
            done.update(e.params)
        return rest

    def rehearse(self, batch: list[tuple[str, torch.Tensor]],
                 load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], Any]) -> int:
        """Record `load_weights` on the batch's tensors without a valid entry, one tensor at a
        time, skipping every write into a parameter (nothing of the model changes; call after
        `refresh`); how many tensors were recorded, yielding the GIL between tensors (this runs
        in a thread beside the engine's serving loop: held for a whole recording, about 1 ms of
        Python per tensor, the loop's steps waited). The yield sleeps `_YIELD_S`: `sleep(0)`
        drops the lock and takes it back before a waiting thread has woken up. A tensor whose
        loader raises (e.g. into a parameter it expects to be re-created first) is left to the
        real load."""
        _, rest = self.split(batch)
        held = {n: p.data for n, p in self._params.items()}
        done = 0
        try:
            for item in rest:
                if self.off:
                    break
                time.sleep(_YIELD_S)  # the engine's loop, serving beside this, takes the GIL
                entries = dict(self.entries)
                try:
                    with self.recording([item], dry=True) as weights:
                        load_weights(weights)
                    done += 1
                except Exception as e:  # noqa: BLE001 - the real load records it, as before
                    log.debug("rehearsing %r failed, left to the load: %r", item[0], e)
                    self.entries = entries
        finally:  # `param.data = ...` is no ATen op: undo it, and never rehearse such a loader
            moved = [n for n, p in self._params.items() if _storage(p) != _storage(held[n])]
            for n in moved:
                self._params[n].data = held[n]
            if moved:
                self._disable(f"the loader replaced the storage of {moved[0]!r}")
        return 0 if self.off else done

    @contextlib.contextmanager
    def recording(self, batch: list[tuple[str, torch.Tensor]],
                  dry: bool = False) -> Iterator[Iterable]:
        """Run the loader on the iterable this yields (the batch, each tensor marked current
        as the loader takes it); what it wrote becomes the batch's entries (`dry`: without
        writing it, see `rehearse`)."""
        self._recording, self._fresh = {}, set()

        def marked() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in batch:
                self._current = (name, t)
                self._recording[name] = _Entry(_signature(t))
                yield name, t
            self._current = None

        if self.off:
            yield iter(batch)
            return
        try:
            with _Recorder(self, dry):
                yield marked()
        finally:
            self._current = None
        if not self.off:
            self.entries.update(self._recording)
        self._recording, self._fresh = {}, set()

    # ------------------------------------------------------------------ recording

    def _disable(self, why: str) -> None:
        log.info("loads of this model are not replayed (each goes through its loader): %s", why)
        self.off = why
        self.entries.clear()
        self.graphs.clear()

    def _see(self, func: Any, args: tuple, kwargs: dict) -> None:
        written = [a for a in _written_args(func, args, kwargs)
                   if isinstance(a, torch.Tensor) and a.numel() and a.device.type != "meta"]
        for dst in written:
            ptr = _storage(dst)[0]
            pname = self._by_storage.get(ptr)
            if pname is not None:
                self._record(func, args, kwargs, dst, pname)
            elif ptr not in self._fresh:  # not the loader's own temporary either
                current = self._current[0] if self._current else "a tensor"
                self._disable(f"loading {current!r} wrote into a tensor that is not a "
                              f"parameter ({func})")

    def _allocated(self, func: Any, out: Any) -> None:
        """Note the storages `func` allocated (its results that alias no argument)."""
        results = out if isinstance(out, (tuple, list)) else (out,)
        for ret, t in zip(func._schema.returns, results, strict=False):
            if isinstance(t, torch.Tensor) and ret.alias_info is None:
                self._fresh.add(_storage(t)[0])

    def _record(self, func: Any, args: tuple, kwargs: dict, dst: torch.Tensor, pname: str) -> None:
        param = self._params[pname]
        if self._current is None:
            return self._disable(f"{pname} was written outside the loading of a tensor")
        name, t = self._current
        if dst.dtype != param.dtype:
            return self._disable(f"{pname} was written as {dst.dtype}, it holds {param.dtype}")
        view = (dst.storage_offset(), tuple(dst.shape), tuple(dst.stride()))
        entry = self._recording[name]
        if func in _FILLS:
            value = 0 if func is _aten.zero_.default else args[1]
            op = _Op(pname, view, None, value)
        elif func is _aten.copy_.default:
            src = args[1]
            offset = _within(src, t)
            if offset is None:
                return self._disable(f"loading {name!r} copied into {pname} from another tensor "
                                     "than the one loaded (a computed or converted value)")
            op = _Op(pname, view, (offset, tuple(src.shape), tuple(src.stride())),
                     non_blocking=bool(args[2] if len(args) > 2 else kwargs.get("non_blocking")))
        else:
            return self._disable(f"loading {name!r} wrote into {pname} with {func}")
        entry.ops.append(op)
        entry.params[pname] = self._now[pname]


def _written_args(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    """The arguments `func` writes to (its schema's mutable ones, `out=` included)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        info = arg.alias_info
        if info is None or not info.is_write:
            continue
        if i < len(args) and not arg.kwarg_only:
            out.append(args[i])
        elif arg.name in kwargs:
            out.append(kwargs[arg.name])
    return out


def _span(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Elements from a view's first to one past its last (0 when empty)."""
    if 0 in shape:
        return 0
    return 1 + sum((n - 1) * abs(s) for n, s in zip(shape, stride, strict=True))


def _within(src: Any, t: torch.Tensor) -> int | None:
    """The element offset of view `src` in tensor `t` (same dtype, inside `t`'s bytes), or
    None if `src` is not such a view."""
    if not isinstance(src, torch.Tensor) or src.dtype != t.dtype or src.device != t.device:
        return None
    if _storage(src)[0] != _storage(t)[0] or not t.is_contiguous():
        return None
    item = t.element_size()
    start = src.data_ptr() - t.data_ptr()
    if start < 0 or start % item:
        return None
    span = _span(tuple(src.shape), tuple(src.stride()))
    if any(s < 0 for s in src.stride()) or start // item + span > math.prod(t.shape):
        return None
    return start // item
