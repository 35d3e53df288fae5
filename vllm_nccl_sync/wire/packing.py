"""Packing: how named tensors become buckets of bytes and back. Pure: no sockets, no collectives.

A bucket is laid out as the slots of its header say: each slot's bytes start at an offset aligned
to `ALIGN` (so views of the buffer are valid, well-aligned tensors of any dtype) and the bucket's
`length` is the end of its last slot. Padding between slots is below `ALIGN` bytes each, and there
is none after the last one: what goes on the wire is `length` bytes, never the buffer's capacity.
A tensor larger than the bucket capacity is cut into chunks spread over consecutive buckets: whole
rows of its dim 0 when a row fits in a bucket (else whole elements). The receiver either hands
whole-row chunks straight to a loader that can load rows in place (`RowLoader`), or reassembles
the tensor first.

Shard to shard, a slot may carry only some blocks of its tensor (`Slot.blocks`): the sender cuts
them out (`Region`), and the receiver writes them into the tensor's shape where the worker's
loaders read them (`Reassembler`, given the worker's read set); the rest of that tensor holds NaN
(zeros for integers), which no loader of that worker reads. A staged update keeps the blocks
compact instead (`Blocks`) and writes them into their tensors only when it loads (`wholes`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import torch

from vllm_nccl_sync.wire.protocol import Block, BucketHeader, Read, Slot, Source

ALIGN = 64
"""Byte alignment of every slot's offset in a bucket."""

_MAX_INT64 = 2**63 - 1  # torch sizes are int64

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of `dtype`; raises `ValueError` for dtypes the protocol does not carry."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} is not supported on the wire") from None


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def tensor_nbytes(dtype: str, shape: list[int]) -> int:
    return 0 if 0 in shape else math.prod(shape) * DTYPES[dtype].itemsize


def slot_total(s: Slot) -> int:
    """Bytes the slot's `start`/`nbytes` index: its tensor's, or its blocks' (`Slot.blocks`)."""
    if s.blocks is None:
        return tensor_nbytes(s.dtype, s.shape)
    return sum(b.numel() for b in s.blocks) * DTYPES[s.dtype].itemsize


def overlaps(a: Block, b: Block) -> bool:
    """Whether `a` and `b` share an element."""
    return all(max(x0, y0) < min(x1, y1)
               for x0, x1, y0, y1 in zip(a.start, a.stop, b.start, b.stop, strict=True))


def inside(a: Block, b: Block) -> bool:
    """Whether every element of `a` is in `b`."""
    return all(y0 <= x0 and x1 <= y1
               for x0, x1, y0, y1 in zip(a.start, a.stop, b.start, b.stop, strict=True))


def blocks_problem(shape: list[int], blocks: list[Block]) -> str:
    """What makes `blocks` no set of disjoint blocks of a tensor of `shape` ("" if nothing)."""
    for b in blocks:
        if not len(b.start) == len(b.stop) == len(shape):
            return f"block {b.start}..{b.stop} has not the {len(shape)} dims of {shape}"
        if not all(0 <= a <= z <= n for a, z, n in zip(b.start, b.stop, shape, strict=True)):
            return f"block {b.start}..{b.stop} is outside the tensor's shape {shape}"
    for i, a in enumerate(blocks):
        for b in blocks[i + 1:]:
            if overlaps(a, b):
                return f"blocks {a.start}..{a.stop} and {b.start}..{b.stop} overlap"
    return ""


def block_index(b: Block, origin: list[int] | None = None) -> tuple[slice, ...]:
    """`b` as an index of a tensor (`origin`: subtracted from its bounds first)."""
    o = origin or [0] * len(b.start)
    return tuple(slice(x - y, z - y) for x, z, y in zip(b.start, b.stop, o, strict=True))


class Region:
    """Some blocks of a tensor as one flat run of elements, as a slot with `blocks` carries them:
    cut into buckets like a 1-d tensor (`cut`), its elements copied out when first packed."""

    def __init__(self, tensor: torch.Tensor, blocks: list[Block]) -> None:
        self.tensor, self.blocks = tensor, blocks
        self.dtype = tensor.dtype
        self.device = tensor.device
        self.shape = [sum(b.numel() for b in blocks)]

    def numel(self) -> int:
        return self.shape[0]

    def element_size(self) -> int:
        return self.tensor.element_size()

    def detach(self) -> Region:
        return self

    def reshape(self, *_: int) -> Region:
        return self

    @cached_property
    def bytes(self) -> torch.Tensor:
        """The blocks' elements, one block after the other, as flat bytes."""
        parts = [self.tensor[block_index(b)].reshape(-1) for b in self.blocks]
        flat = parts[0] if len(parts) == 1 else torch.cat(parts) if parts else \
            self.tensor.new_empty(0)  # one block of whole rows: a view, no copy
        return flat.view(torch.uint8)


def _numel_exceeds(shape: list[int], limit: int) -> bool:
    """Whether the product of `shape` (non-negative) exceeds `limit`; never builds a huge int."""
    if 0 in shape:
        return False
    n = 1
    for d in shape:
        n *= d
        if n > limit:
            return True
    return False


def _row_bytes(shape: list[int], itemsize: int) -> int:
    """Bytes of one row of dim 0 (one element for a 0-d or 1-d tensor, or empty rows)."""
    return (math.prod(shape[1:]) * itemsize if len(shape) > 1 else 0) or itemsize


@dataclass(slots=True)
class Bucket:
    """One planned bucket: its slots and, slot for slot, the source tensors they copy from."""

    slots: list[Slot] = field(default_factory=list)
    sources: list[torch.Tensor] = field(default_factory=list)
    to: list[int] | None = None
    """The receivers it goes to (`BucketHeader.to`; None: every receiver)."""

    @property
    def length(self) -> int:
        return self.slots[-1].offset + self.slots[-1].nbytes if self.slots else 0

    def header(
        self,
        version: int,
        seq: int,
        is_last: bool,
        protocol: int,
        force: bool = False,
        staged: bool = False,
        at: list[Source] | None = None,
    ) -> BucketHeader:
        return BucketHeader(protocol, version, seq, self.length, is_last, self.slots, force, staged,
                            at=at, to=self.to)

    def moving(self) -> tuple[Slot, torch.Tensor] | None:
        """The bucket's one moving slot and its flat source when that slot is the whole bucket
        (zero-byte slots beside it move nothing): a bucket a sender can send from where its
        bytes lie; else None."""
        moving = [(s, t) for s, t in zip(self.slots, self.sources, strict=True) if s.nbytes]
        return moving[0] if len(moving) == 1 and moving[0][0].offset == 0 else None


GLOO_ALONE_BYTES = 4 << 20
"""gloo: tensors from this size travel alone (measured with `vllm-nccl-sync bench`: on a CPU the
pack copy costs more than the few tens of microseconds of one more message)."""


def alone_bytes(capacity: int, backend: str) -> int:
    """The size from which a tensor gets buckets of its own (sent from its memory, no pack):
    half a bucket on NCCL, where a pack is a fast on-device copy beside the link and each
    collective has a fixed cost; at most `GLOO_ALONE_BYTES` on gloo; a whole bucket on the
    same-host planes, whose sender packs every byte into the shared buffers anyway."""
    half = capacity // 2
    if backend in ("shm", "ipc"):
        return capacity
    return min(half, GLOO_ALONE_BYTES) if backend == "gloo" else half


def cut(
    named_tensors: Iterable[tuple[str, torch.Tensor]], capacity: int, alone: int | None = None
) -> Iterator[tuple[Slot, torch.Tensor] | None]:
    """The bucket layout of a stream of named tensors, lazily: `(slot, flat source)` per slot,
    and `None` where a bucket closes (before the slot that no longer fits).

    Tensors keep their order. A tensor that does not fit the rest of the current bucket starts a
    new one. A tensor of at least `alone` bytes (default: half the capacity; `alone_bytes`) has
    buckets of its own (none shared with other tensors but zero-byte ones), so a sender can
    broadcast it straight from its memory and a receiver can load it by rows, without a copy; a
    tensor larger than `capacity` is split into chunks (whole rows of dim 0 when one fits, else
    whole elements) that fill buckets. Only the tensor being cut is referenced here: the next one
    is pulled after it is let go.
    """
    if capacity < ALIGN or capacity % ALIGN:
        raise ValueError(f"bucket capacity {capacity} must be a positive multiple of {ALIGN}")
    alone_from = capacity // 2 if alone is None else alone
    used, nonempty = 0, False
    for name, tensor in named_tensors:
        dtype = dtype_name(tensor.dtype)
        shape = list(tensor.shape)
        flat = tensor.detach().reshape(-1)
        del tensor
        total = flat.numel() * flat.element_size()
        itemsize = flat.element_size()
        solo = total >= alone_from
        if nonempty and (solo or align_up(used) + total > capacity):
            yield None
            used, nonempty = 0, False
        unit = _row_bytes(shape, itemsize)  # chunks of an oversize tensor: whole rows if they fit
        if unit > capacity:
            unit = itemsize
        start = 0
        while True:
            offset = align_up(used)
            if offset >= capacity or (start < total and capacity - offset < unit):
                yield None
                used, offset, nonempty = 0, 0, False
            room = (capacity - offset) // unit * unit
            n = min(total - start, room)
            yield Slot(name, dtype, shape, offset, n, start), flat
            used, nonempty = offset + n, nonempty or n > 0  # zero-byte slots share any bucket
            start += n
            if start >= total:
                break
        if solo:  # nothing shares its last bucket either
            used = capacity
        del flat


def plan_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], capacity: int, alone: int | None = None
) -> Iterator[Bucket]:
    """Cut a stream of named tensors into buckets of at most `capacity` bytes, lazily (`cut`);
    each bucket keeps references to its source tensors until it is packed."""
    cur = Bucket()
    for ev in cut(named_tensors, capacity, alone):
        if ev is None:
            yield cur
            cur = Bucket()
        else:
            cur.slots.append(ev[0])
            cur.sources.append(ev[1])
    if cur.slots:
        yield cur


class StreamPacker:
    """Packs a stream of named tensors straight into buffers as it is consumed.

    Each tensor is copied into the bucket being filled as soon as it is pulled and let go once
    its last byte is copied, so a trainer gathering full tensors one at a time (FSDP) never holds
    more than one of them beyond the two buffers.
    """

    def __init__(self, named_tensors: Iterable[tuple[str, torch.Tensor]], capacity: int) -> None:
        self._events = cut(named_tensors, capacity)
        self._held: tuple[Slot, torch.Tensor] | None = None  # the slot that closed a bucket
        self.done = False

    def fill(self, buf: torch.Tensor) -> tuple[list[Slot], bool]:
        """Copy the next bucket into `buf`; returns its slots and whether it is the last one."""
        slots: list[Slot] = []
        while True:
            ev, self._held = self._held, None
            if ev is None:
                ev = next(self._events, _END)
            if ev is _END:
                self.done = True
                return slots, True
            if ev is None:  # a bucket closes here
                ev = next(self._events, _END)
                if ev is not _END:
                    self._held = ev
                    return slots, False
                self.done = True
                return slots, True
            slot, flat = ev
            ev = None
            data = as_bytes(flat)[slot.start : slot.start + slot.nbytes]
            buf[slot.offset : slot.offset + slot.nbytes].copy_(data, non_blocking=True)
            del flat, data
            slots.append(slot)


_END = object()


def as_bytes(t: torch.Tensor | Region) -> torch.Tensor:
    """A flat uint8 view of a tensor's bytes (copied first if not contiguous)."""
    if isinstance(t, Region):
        return t.bytes
    return t.contiguous().reshape(-1).view(torch.uint8)


def pack(bucket: Bucket, buf: torch.Tensor, views: dict[int, tuple] | None = None,
         seq: int = 0) -> torch.Tensor:
    """Copy the bucket's sources into `buf` (uint8) and return `buf[:length]`, the wire bytes.

    `views` (kept by the caller from update to update): per `seq`, the views of `buf` that a
    bucket of whole tensors was packed into, with its buffer, slots and sources' shapes; the
    same again reuses them, and the bucket is copied in one call (no per-tensor
    view or copy made in Python: a view costs a few microseconds, a layout of 171 tensors ~1 ms).
    """
    kept = views.get(seq) if views is not None else None
    if kept is None or kept[0] != buf.data_ptr() or kept[1] != bucket.slots or \
            kept[3] != [getattr(t, "shape", None) for t in bucket.sources]:
        kept = _pack_views(bucket, buf)
        if views is not None and kept is not None:
            views[seq] = kept
    if kept is not None:
        torch._foreach_copy_(kept[2], bucket.sources, non_blocking=True)
        return buf[: bucket.length]
    for slot, src in zip(bucket.slots, bucket.sources, strict=True):
        data = as_bytes(src)[slot.start : slot.start + slot.nbytes]
        buf[slot.offset : slot.offset + slot.nbytes].copy_(data, non_blocking=True)
    return buf[: bucket.length]


def _pack_views(bucket: Bucket, buf: torch.Tensor) -> tuple | None:
    """`buf`'s data pointer, the bucket's slots, per slot the view of `buf` its source is
    copied into as it is (same dtype and shape), and the sources' shapes; None unless every slot
    is a whole tensor (a chunk or a region is copied as bytes)."""
    out = []
    for s, src in zip(bucket.slots, bucket.sources, strict=True):
        if not (isinstance(src, torch.Tensor) and s.start == 0
                and s.nbytes == src.numel() * src.element_size()
                and dtype_name(src.dtype) == s.dtype):
            return None
        out.append(buf[s.offset : s.offset + s.nbytes].view(src.dtype).view(src.shape))
    return buf.data_ptr(), bucket.slots, out, [t.shape for t in bucket.sources]


def validate_header(header: BucketHeader, expected_seq: int, capacity: int) -> None:
    """Check a decoded header against the rules between its fields before any byte moves;
    `ValueError` naming the first one broken.

    The types already hold each value to its bounds (non-negative sizes, at most `MAX_DIMS`
    dimensions of at most 2**63 - 1, bounded names and slot counts: `protocol.py`), as `decode`
    enforces them. Rules here: the expected sequence number; `length <= capacity`; unique names;
    known dtypes; shapes of at most 2**63 - 1 bytes; aligned, in-range, non-overlapping slots;
    whole elements; chunk ranges inside their tensor; `length` equal to the end of the last
    slot (no bytes beyond the payload); and a bucket read where it lies (`at`) holding one slot's
    bytes (the range itself is the data plane's to check: `Transport.mapped`).
    """
    if header.seq != expected_seq:
        kind = "repeat" if header.seq < expected_seq else "gap"
        raise ValueError(f"bucket sequence {kind}: got seq {header.seq}, expected {expected_seq}")
    if header.length > capacity:
        raise ValueError(f"bucket length {header.length} outside [0, capacity {capacity}]")
    end = 0
    names: set[str] = set()
    for s in header.slots:
        if s.name in names:
            raise ValueError(f"tensor {s.name!r}: duplicate name in one bucket")
        names.add(s.name)
        end = _check_slot(s, end, header.length)
    if end != header.length:
        raise ValueError(f"bucket length {header.length} != end of its last tensor {end}")
    if header.at is not None:
        if len(header.at) != len(header.slots):
            raise ValueError(f"a bucket read where it lies names {len(header.at)} places for "
                             f"{len(header.slots)} slots")
        if not all(s.nbytes for s in header.slots):
            raise ValueError("a bucket read where it lies holds no empty slot")


def _check_slot(s: Slot, end: int, length: int) -> int:
    """`validate_header`'s rules for one slot, which follows bytes ending at `end` in a bucket of
    `length` bytes; the end of this slot's bytes."""
    if s.dtype not in DTYPES:
        raise ValueError(f"tensor {s.name!r}: unknown dtype {s.dtype!r}")
    itemsize = DTYPES[s.dtype].itemsize
    if _numel_exceeds(s.shape, _MAX_INT64 // itemsize):
        raise ValueError(f"tensor {s.name!r}: shape too large for a tensor")
    if s.blocks is not None and (why := blocks_problem(s.shape, s.blocks)):
        raise ValueError(f"tensor {s.name!r}: {why}")
    total = slot_total(s)
    if s.offset < end:
        raise ValueError(f"tensor {s.name!r}: offset {s.offset} overlaps the previous slot")
    if s.offset % ALIGN:
        raise ValueError(f"tensor {s.name!r}: offset {s.offset} not aligned to {ALIGN}")
    if s.nbytes % itemsize or s.start % itemsize:
        raise ValueError(f"tensor {s.name!r}: byte range not made of whole {s.dtype} elements")
    if s.start + s.nbytes > total:
        raise ValueError(
            f"tensor {s.name!r}: bytes [{s.start}, {s.start + s.nbytes}) exceed its size {total}"
        )
    if s.nbytes == 0 and total != 0:
        raise ValueError(f"tensor {s.name!r}: empty chunk of a non-empty tensor")
    if s.blocks is not None and not total:
        raise ValueError(f"tensor {s.name!r}: a slot of blocks holding no element")
    end = s.offset + s.nbytes
    if end > length:
        raise ValueError(f"tensor {s.name!r}: bytes end at {end}, past the bucket length {length}")
    return end


RowLoader = Callable[[str, torch.Tensor, int, list[int]], bool]
"""`load_rows(name, rows, first_row, shape)`: load `rows` (whole rows of dim 0 of the full tensor
`name` of `shape`, starting at row `first_row`) in place; False (at a tensor's first chunk) if
this tensor cannot be loaded piecewise, so it is reassembled instead."""


def chunk_key(s: Slot) -> str | tuple:
    """What a chunked slot's chunks have in common: its tensor, and its blocks if it has them."""
    if s.blocks is None:
        return s.name
    return s.name, tuple((tuple(b.start), tuple(b.stop)) for b in s.blocks)


def _blank(name: str, dtype: torch.dtype, shape: list[int], device: torch.device) -> torch.Tensor:
    """A tensor of `dtype` and `shape` that blocks are written into: NaN where it is floating
    point (zeros else), so that an element no block wrote shows rather than passes."""
    fill = float("nan") if dtype.is_floating_point else 0
    try:
        return torch.full(shape, fill, dtype=dtype, device=device)
    except (RuntimeError, MemoryError) as e:  # includes torch.OutOfMemoryError
        raise ValueError(f"tensor {name!r}: cannot allocate its shape {shape} to write "
                         f"its blocks into: {e}") from None


class Blocks:
    """The blocks of a tensor this worker reads, held compact (a staged update keeps only
    them: TP x less memory than the tensor) until `whole()` writes them into a tensor of its
    full shape, NaN elsewhere, for the loader."""

    def __init__(self, name: str, dtype: torch.dtype, shape: list[int]) -> None:
        self.name, self.dtype, self.shape = name, dtype, shape
        self.parts: list[tuple[Block, torch.Tensor]] = []

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor `whole()` makes."""
        return math.prod(self.shape) * self.dtype.itemsize

    def whole(self) -> torch.Tensor:
        device = self.parts[0][1].device if self.parts else torch.device("cpu")
        out = _blank(self.name, self.dtype, self.shape, device)
        for b, part in self.parts:
            out[block_index(b)].copy_(part)
        return out


def wholes(staged: list[tuple[str, torch.Tensor | Blocks]],
           limit: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """`staged` in batches for the loader, each tensor held as `Blocks` made whole; a batch
    ends once the tensors made whole in it exceed `limit` bytes (so at most about that much is
    held beside the blocks), and is one batch when there are none."""
    batch: list[tuple[str, torch.Tensor]] = []
    made = 0
    for name, t in staged:
        if isinstance(t, Blocks):
            made += t.nbytes
            t = t.whole()
        batch.append((name, t))
        if made > limit:
            yield batch
            batch, made = [], 0
    if batch:
        yield batch


class KeptViews(NamedTuple):
    """A bucket of whole tensors as `Reassembler` unpacked it, kept for the same bucket again."""

    where: tuple[tuple[int, int], ...]
    """Where its bytes lay (`_where`)."""
    slots: list[Slot]
    tensors: list[tuple[str, torch.Tensor]]
    in_place: bool
    """Read where it lies (one flat tensor per slot, views of the sender's memory mapped)."""


def forget_in_place(views: dict[int, KeptViews]) -> None:
    """Drop from `views` (`Reassembler`'s) the buckets read where they lie: their views hold
    the sender's memory mapped, which a new plan may no longer name."""
    for seq in [seq for seq, kept in views.items() if kept.in_place]:
        del views[seq]


def _where(buf: torch.Tensor | list[torch.Tensor]) -> tuple[tuple[int, int], ...]:
    """Where a bucket's bytes lie: the buffer's, or each slot's (address, bytes)."""
    return tuple((p.data_ptr(), p.numel()) for p in (buf if isinstance(buf, list) else [buf]))


class Reassembler:
    """Turns received buckets back into whole named tensors (views of the buffer when possible).

    A tensor split over buckets goes, chunk by chunk, straight to `load_rows` when its chunks are
    whole rows and the loader takes them (no staging copy: a receiver's extra memory stays at its
    two buffers); otherwise it is copied into a staging tensor until its last chunk arrives.
    Chunks must arrive in order. Blocks of a tensor (`Slot.blocks`) are written into a tensor of
    its shape (or, given `keep_blocks`, kept compact as `Blocks`), handed on once every element
    this worker reads of it (`reads`) arrived. Call
    `finish()` at the end to catch tensors left incomplete.
    """

    def __init__(self, load_rows: RowLoader | None = None,
                 reads: Mapping[str, Read] | None = None,
                 keep_blocks: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 views: dict[int, KeptViews] | None = None) -> None:
        self._partial: dict[str | tuple, tuple[Slot, torch.Tensor, int]] = {}
        self._load_rows = load_rows
        self._direct: dict[str, tuple[Slot, int]] = {}  # tensors loaded by rows: bytes so far
        self._reads = reads or {}
        self._keep_blocks = keep_blocks
        """Given: blocks are kept compact (a copy of each, by it), handed on as `Blocks`."""
        self._views = views
        """Given (kept by the caller from update to update): per bucket seq, the tensors a
        bucket of whole tensors was unpacked into, with where its bytes lay and its slots; the
        same bucket from the same bytes again (the same buffer, or the same mapped parts of a
        bucket read where it lies) is unpacked into the same views, not made again."""
        self._written: dict[str, tuple[torch.Tensor | Blocks, int]] = {}
        """Tensors whose blocks are arriving: the tensor (or its `Blocks`), and the elements
        written so far."""
        self.loaded_by_rows = 0
        """Tensors completed through `load_rows` (they are not in `unpack`'s result)."""

    def _rows(self, s: Slot, data: torch.Tensor, total: int) -> bool:
        """Hand chunk `s` to `load_rows` if it is whole rows and the loader takes the tensor."""
        itemsize = DTYPES[s.dtype].itemsize
        unit = _row_bytes(s.shape, itemsize)
        if s.start % unit or s.nbytes % unit:
            return False
        first, got = self._direct.get(s.name, (s, -1))
        if got < 0 and (s.start != 0 or s.name in self._partial):
            return False
        if got >= 0 and (s.start != got or s.dtype != first.dtype or s.shape != first.shape):
            raise ValueError(f"tensor {s.name!r}: chunk at byte {s.start} out of order (expected "
                             f"{got}) or with another dtype/shape")
        rows = data.view(DTYPES[s.dtype]).view([s.nbytes // unit, *s.shape[1:]])
        took = self._load_rows(s.name, rows, s.start // unit, list(s.shape))
        if got < 0 and not took:
            return False
        if not took:
            raise ValueError(f"tensor {s.name!r}: the loader took its first rows, then refused "
                             f"rows from byte {s.start}")
        got = max(got, 0) + s.nbytes
        if got == total:
            self._direct.pop(s.name, None)
            self.loaded_by_rows += 1
        else:
            self._direct[s.name] = (first, got)
        return True

    def unpack(self, header: BucketHeader,
               buf: torch.Tensor | list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """The tensors completed by this bucket, as `(name, tensor)`; views of `buf` if whole.
        `buf`: the bucket's bytes, or one flat tensor per slot (a bucket read where it lies)."""
        where = _where(buf) if self._views is not None else None
        kept = self._views.get(header.seq) if self._views is not None else None
        if kept is not None and kept.where == where and kept.slots == header.slots \
                and not (self._partial or self._direct or self._written):
            return list(kept.tensors)
        out: list[tuple[str, torch.Tensor]] = []
        for i, s in enumerate(header.slots):
            data = buf[i] if isinstance(buf, list) else buf[s.offset : s.offset + s.nbytes]
            if s.start == 0 and s.nbytes == slot_total(s):
                self._whole(s, data, out)
            elif s.blocks is None and self._load_rows is not None and \
                    self._rows(s, data, tensor_nbytes(s.dtype, s.shape)):
                continue
            elif s.name in self._direct:
                raise ValueError(f"tensor {s.name!r}: a chunk of rows that is not whole rows")
            elif (staged := self._chunk(s, data)) is not None:
                self._whole(s, staged, out)
        if self._views is not None and all(
                s.blocks is None and s.start == 0 and s.nbytes == slot_total(s)
                for s in header.slots):
            self._views[header.seq] = KeptViews(where, header.slots, list(out),
                                                isinstance(buf, list))
        return out

    def _whole(self, s: Slot, data: torch.Tensor, out: list[tuple[str, torch.Tensor]]) -> None:
        """All of slot `s`'s bytes (`data`), as a tensor to load or blocks to write."""
        if s.blocks is not None:
            self._write(s, data, out)
            return
        if s.start == 0 and (s.name in self._partial or s.name in self._direct):
            raise ValueError(f"tensor {s.name!r}: sent whole while chunks are pending")
        out.append((s.name, data.view(DTYPES[s.dtype]).view(s.shape)))

    def _chunk(self, s: Slot, data: torch.Tensor) -> torch.Tensor | None:
        """Chunk `s` copied into its staging tensor; the staging tensor once it is complete."""
        key, total = chunk_key(s), slot_total(s)
        first, staging, got = self._partial.get(key, (s, None, 0))
        if staging is None:
            if s.start != 0:
                raise ValueError(f"tensor {s.name!r}: chunk at byte {s.start} before byte 0")
            try:
                staging = torch.empty(total, dtype=torch.uint8, device=data.device)
            except (RuntimeError, MemoryError) as e:  # includes torch.OutOfMemoryError
                msg = f"tensor {s.name!r}: cannot allocate {total} bytes to reassemble it: {e}"
                raise ValueError(msg) from None
        elif s.start != got or s.dtype != first.dtype or s.shape != first.shape:
            raise ValueError(
                f"tensor {s.name!r}: chunk at byte {s.start} out of order (expected {got})"
                " or with another dtype/shape"
            )
        staging[s.start : s.start + s.nbytes].copy_(data, non_blocking=True)
        got += s.nbytes
        if got < total:
            self._partial[key] = (first, staging, got)
            return None
        del self._partial[key]
        return staging

    def _write(self, s: Slot, data: torch.Tensor, out: list[tuple[str, torch.Tensor]]) -> None:
        """Write the blocks `s` carries (`data`: all their bytes) into their tensor; hand it on
        once every element this worker reads of it is written."""
        want = self._reads.get(s.name)
        if want is None:
            raise ValueError(f"tensor {s.name!r}: blocks of it arrived, and this worker "
                             "published no read of it")
        dtype = DTYPES[s.dtype]
        tensor, got = self._written.get(s.name) or (
            Blocks(s.name, dtype, s.shape) if self._keep_blocks is not None
            else _blank(s.name, dtype, s.shape, data.device), 0)
        off = 0
        for b in s.blocks or []:
            n = b.numel()
            size = [z - a for a, z in zip(b.start, b.stop, strict=True)]
            part = data[off * dtype.itemsize : (off + n) * dtype.itemsize].view(dtype).view(size)
            if isinstance(tensor, Blocks):
                tensor.parts.append((b, self._keep_blocks(part)))
            else:
                tensor[block_index(b)].copy_(part)
            off, got = off + n, got + n
        if got < want.numel():
            self._written[s.name] = (tensor, got)
            return
        self._written.pop(s.name, None)
        out.append((s.name, tensor))

    def finish(self) -> None:
        """Raise if a chunked tensor is still incomplete at the end of an update."""
        if self._partial or self._direct or self._written:
            names = ", ".join(sorted({str(k if isinstance(k, str) else k[0])
                                      for k in [*self._partial, *self._direct, *self._written]}))
            raise ValueError(f"update ended with incomplete tensors: {names}")
