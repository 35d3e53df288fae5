"""The book-keeping of one update on one receiver, and the checks of its plan and headers.

A plan is accepted or refused as a whole: every header it carries is checked before the one
`Ready` (or `Error`) that answers it. A stream's later headers are checked one by one. Across the
plan's tensor list and every header of the update, stream headers included, each tensor (or each
byte range of a tensor cut over several buckets) is named once.

Shard to shard, a header may be for some receivers only (`BucketHeader.to`): the others check its
fields and join none of its collectives. Blocks of a tensor (`Slot.blocks`) come in a plan's
headers only, each inside what this worker reads of it (`reads`), none twice; the plan must name
every element the worker reads of each tensor it sends blocks of, or it is refused before any
byte moves.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from vllm_nccl_sync.engine.handshake import Reference
from vllm_nccl_sync.engine.residency import Residency
from vllm_nccl_sync.engine.state import ReceiverState, held_weights
from vllm_nccl_sync.outcomes import Kind, Problem, clip
from vllm_nccl_sync.wire.packing import chunk_key, inside, overlaps, validate_header
from vllm_nccl_sync.wire.protocol import (
    AdapterSpec,
    Block,
    BucketHeader,
    Plan,
    Read,
    Slot,
    TensorSpec,
    belongs,
)


@dataclass(frozen=True, slots=True)
class Layout:
    """A plan this receiver checked and accepted: what its checks left (every header's tensors
    and blocks), kept so that the next plan of the same layout (every header and tensor alike
    but the version) is accepted without checking each header again. The checks depend on
    nothing else: the model's reference and read set are this receiver's until it joins again
    (a new receiver), and whether it records every tensor named is in the key."""

    key: tuple
    covered: dict[str | tuple, int]
    regions: dict[str, list[Block]]
    named: dict[str, TensorSpec]
    plan: Plan
    """The plan (its `layout` id: what a `Repeat` names)."""


def _layout_key(plan: Plan, u: Update) -> tuple:
    """What the checks of `plan`'s headers depend on, but its version."""
    return (plan.protocol, plan.tensors, plan.force, plan.adapter, u.staged, u.capacity,
            u.senders, u.held is not None,
            [(h.protocol, h.seq, h.length, h.is_last, h.slots, h.force, h.staged, h.src, h.at,
              h.to) for h in plan.buckets])


@dataclass(slots=True)
class Update:
    """The update in progress on receiver `rank` (buckets of at most `capacity` bytes, from
    `senders` senders)."""

    rank: int
    capacity: int
    senders: int = 1
    version: int = -1
    staged: bool = False
    seq: int = 0
    """The bucket being received."""
    headers: dict[int, BucketHeader] = field(default_factory=dict)
    """Accepted headers of buckets not yet received."""
    accepted: int = -1
    """The highest header accepted (answered `Ready`)."""
    refused: int = -1
    """The first bucket this receiver will not join (its header refused or left unanswered);
    -1: none. A `Go` covering it means the sender posts a collective nobody here joins."""
    agreed: int = -1
    """The highest bucket a `Go` covers."""
    last: int = -1
    """Seq of the header marked `is_last` once accepted (-1: not yet)."""
    covered: dict[str | tuple, int] = field(default_factory=dict)
    """Per tensor named so far (per its blocks, for a slot of blocks): where its bytes end."""
    reads: dict[str, Read] | None = None
    """What this worker reads of each checkpoint tensor (None: it published no read set)."""
    regions: dict[str, list[Block]] = field(default_factory=dict)
    """Per tensor sent in blocks: the blocks named for this worker so far."""
    opening: bool = False
    """The plan's own headers are being checked (blocks may travel there only)."""
    posted: dict[int, Any] = field(default_factory=dict)
    """Per posted bucket: (handle, canary); removed once arrived."""
    digests: dict[int, int] = field(default_factory=dict)
    """The sender's `Digest` of each bucket (planes that check each bucket on its own)."""
    sealed: bool = False
    """The sender's `Seal` was taken: the commit round is open."""
    told: bool = False
    """The sender was sent an `Error` for this update."""
    reference: Reference | None = None
    plan_tensors: dict[str, TensorSpec] = field(default_factory=dict)
    nbytes: int = 0
    ntensors: int = 0
    failed: Problem | None = None
    began: bool = False
    exposed: bool = False
    """Data of this update may have been loaded by some worker: a failure now leaves it mixed."""
    in_step: bool = True
    """Every collective this receiver agreed to was joined (the group stays usable)."""
    sums: list[Any] = field(default_factory=list)
    """Per bucket: the checksum of what arrived (an int, or one queued on the device)."""
    staged_tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    adapter: AdapterSpec | None = None
    """The LoRA adapter this update targets (None: base weights)."""
    beside: Any = None
    """`shadow.BesideReceive` of an update received beside serving (None: paused)."""
    held: Residency | None = None
    """The model's `engine.residency` record when this update must rewrite every weight to
    commit (its `discarded` says why; None: it need not)."""
    named: dict[str, TensorSpec] = field(default_factory=dict)
    """Every tensor the update's headers named (kept when it must rewrite every weight)."""
    layout: Layout | None = None
    """The last plan this receiver accepted; after `open`, this one's (`kept`: the same)."""
    kept: bool = False
    """The plan's layout was the last accepted one's: its headers were not checked again."""
    repeated: bool = False
    """The update opened with a `Repeat` of the last accepted plan's layout."""
    marks: dict[str, float] = field(default_factory=dict)
    """When each step of the update was reached (`perf_counter`): the plan, each bucket arrived
    and loaded, the Seal, its check, the commit round (summed up by `steps_ms`)."""

    @property
    def t0(self) -> float:
        """When the plan was answered: the update's clock starts there."""
        return self.marks["ready"]

    def mark(self, what: str) -> None:
        """Note that step `what` was reached now (also in the beside receive's own marks)."""
        self.marks[what] = time.perf_counter()
        if self.beside is not None:
            self.beside.mark(what)

    def steps_ms(self) -> dict[str, float]:
        """Per kind of step, in the order first reached, the ms spent reaching it from the step
        before, per-bucket steps summed (`kept3` -> `kept`: loading bucket 3): as many entries
        whatever the number of buckets."""
        out: dict[str, float] = {}
        prev = next(iter(self.marks.values()), 0.0)
        for name, t in self.marks.items():
            kind = name.rstrip("0123456789")
            out[kind] = out.get(kind, 0.0) + (t - prev) * 1e3
            prev = t
        return {k: round(v, 3) for k, v in out.items()}

    def open(self, plan: Plan, reference: Reference | None) -> Problem | None:
        """Check every header `plan` carries (the update's version and staged flag already
        taken from it): all of them are accepted, or none (the refusal: the first problem)."""
        if plan.adapter is None:
            self.reference = reference
            self.plan_tensors = {t.name: t for t in plan.tensors}
        if not plan.buckets:
            return Problem(Kind.PLAN, f"rank {self.rank} refused update {plan.version}: a plan "
                           "without buckets")
        key = _layout_key(plan, self)
        if self._keep(plan, key):
            return None
        self.opening = True
        for h in plan.buckets:
            problem = (Problem(Kind.HEADER, f"rank {self.rank} rejected bucket {h.seq}: force "
                               "flag differs from the plan's")
                       if h.force != plan.force else self.accept(h))
            if problem:
                self.refuse(problem)
                return problem
        self.opening = False
        if problem := self.reads_gap():
            self.refuse(problem)
            return problem
        self.layout = Layout(key, dict(self.covered), {n: list(b) for n, b in self.regions.items()},
                             dict(self.named), plan)
        return None

    def _keep(self, plan: Plan, key: tuple) -> bool:
        """Accept `plan` as the last accepted plan was, if its layout is that plan's (every
        header of this version); False: it is checked."""
        a = self.layout
        if a is None or a.key != key or any(h.version != plan.version for h in plan.buckets):
            return False
        if plan.layout != a.plan.layout:  # the same layout under another id
            self.layout = replace(a, plan=plan)
        self.covered, self.named = dict(a.covered), dict(a.named)
        self.regions = {n: list(b) for n, b in a.regions.items()}
        self.headers = {h.seq: h for h in plan.buckets}
        self.accepted = plan.buckets[-1].seq
        self.last = self.accepted if plan.buckets[-1].is_last else -1
        self.kept = True
        return True

    def mine(self, header: BucketHeader) -> bool:
        """Whether this receiver joins bucket `header`'s collective (it is for every receiver,
        or names this one)."""
        return header.to is None or self.rank in header.to

    def reads_gap(self) -> Problem | None:
        """Why the blocks the plan names fall short of what this worker reads (None: they
        cover every tensor sent in blocks, exactly)."""
        for name, blocks in self.regions.items():
            read = (self.reads or {})[name]
            got, want = sum(b.numel() for b in blocks), read.numel()
            if got != want:
                return Problem(Kind.READS, f"rank {self.rank} refused update {self.version}: "
                               f"its plan names {got} of the {want} elements this worker reads "
                               f"of tensor {name!r}")
        return None

    def refuse(self, problem: Problem) -> None:
        """Record the refusal of the whole plan, whichever check refused it: no header is
        accepted, so no `Go` is agreement (a `Go` for any bucket is one nobody here joins)."""
        self.headers, self.accepted, self.last, self.refused = {}, -1, -1, 0
        if self.failed is None:
            self.failed = problem

    def accept(self, header: BucketHeader) -> Problem | None:
        """Check the next header; on success remember it, else record the refusal."""
        seq = self.accepted + 1
        problem = self.failed or self._problem(header, seq)
        if problem:
            if self.refused < 0:
                self.refused = seq
            if self.failed is None:
                self.failed = problem
            return problem
        for s in header.slots if self.mine(header) else ():
            key = chunk_key(s)
            if s.blocks is not None and key not in self.covered:
                self.regions.setdefault(s.name, []).extend(s.blocks)
            self.covered[key] = max(self.covered.get(key, 0), s.start + s.nbytes)
            if self.held is not None:
                self.named.setdefault(s.name, TensorSpec(s.name, s.dtype, s.shape))
        self.headers[seq] = header
        self.accepted = seq
        if header.is_last:
            self.last = seq
        return None

    def residency_problem(self, plan: Plan, residency: Callable[[], Residency] | None,
                          reference: Reference | None) -> Problem | None:
        """Why the engine's sleep state (`engine.residency`; None: not known) refuses `plan`
        (None if it does not). Weights asleep: refused. Weights discarded: the update must
        rewrite every weight (`held`); a state-dict plan must name every checkpoint tensor now,
        a stream by its commit."""
        if residency is None:
            return None
        r = residency()
        where = f"rank {self.rank} refused update {plan.version}"
        if why := r.unwritable:
            return why.at(where)
        if not r.discarded or plan.adapter is not None:
            return None
        if reference is None:
            return Problem(Kind.RESIDENCY, f"{where}: {r.discarded}, and without the engine's "
                           "checkpoint headers it cannot check that the update rewrites every "
                           "weight")
        self.held = r
        missing = reference.problems(plan.tensors, full=True) if plan.tensors else []
        if not missing:
            return None
        return Problem(Kind.RESIDENCY, f"{where}: {r.discarded}; {self.rewrite_needed(missing)}")

    def committed(self, st: ReceiverState) -> None:
        """Record this update, committed, in what the worker holds."""
        if self.adapter is not None:
            st.adapters[self.adapter.name] = self.version
        else:
            st.version, st.consistent = self.version, True
            if self.held is not None:
                self.held.rewritten()  # every weight rewritten: no longer discarded
        st.updates += 1
        st.bytes += self.nbytes
        st.last_seconds = time.perf_counter() - self.t0

    def rewrite_needed(self, missing: list[Problem]) -> str:
        return f"every weight must be rewritten, but {joined(missing)}"

    def coverage_problem(self, loader: Any) -> Problem | None:
        """Why this update, loaded and finished, may not commit because it must rewrite every
        weight and did not (None if it may): a checkpoint tensor no header named, or a parameter
        the loaders wrote nothing into (`loader.unwritten()`, where the loader can tell)."""
        if self.held is None or self.reference is None:
            return None
        where = f"rank {self.rank} refused to commit update {self.version}: {self.held.discarded}"
        missing = self.reference.problems(list(self.named.values()), full=True)
        if missing:
            return Problem(Kind.COVERAGE, clip(f"{where}; {self.rewrite_needed(missing)}"))
        unwritten = getattr(loader, "unwritten", None)
        left = unwritten() if unwritten is not None else None
        if left:
            shown = ", ".join(sorted(left)[:8]) + (" ..." if len(left) > 8 else "")
            return Problem(Kind.COVERAGE, clip(f"{where}; every weight must be rewritten, but "
                           f"the loaders wrote nothing into {len(left)} parameter(s): {shown}"))
        return None

    def _problem(self, header: BucketHeader, seq: int) -> Problem | None:
        """Why this receiver refuses header `seq` (None if it accepts it)."""
        where = f"rank {self.rank} rejected bucket {seq}"
        if not belongs(header, self.version):  # a header nested in the plan
            return Problem(Kind.HEADER, f"header of update {header.version} in update "
                           f"{self.version}")
        if (why := self._rule(header, seq)) is not None:
            return Problem(Kind.HEADER, f"{where}: {why}")
        if not self.mine(header):
            return None
        if (why := self._blocks_rule(header)) is not None:
            return Problem(Kind.READS, f"{where}: {why}")
        specs = [TensorSpec(x.name, x.dtype, x.shape) for x in header.slots]
        strays = [f"tensor {x.name!r} ({x.dtype} {x.shape}) is not the plan's"
                  for x in specs if self.plan_tensors and self.plan_tensors.get(x.name) != x]
        if strays:
            return Problem(Kind.HEADER, f"{where}: " + clip("; ".join(strays[:5])))
        problems = self.reference.problems(specs) if self.reference is not None else []
        return Problem(Kind.MODEL, f"{where}: " + clip(joined(problems[:5]))) if problems else None

    def _rule(self, header: BucketHeader, seq: int) -> str | None:
        """Which of the protocol's rules header `seq` breaks, as the text of its refusal."""
        if header.staged != self.staged:
            return "staged flag differs from the plan's"
        if self.last >= 0:
            return f"it follows the last bucket {self.last}"
        if not 0 <= header.src < self.senders:
            return f"sender {header.src} is not one of the {self.senders} sender(s)"
        try:
            validate_header(header, seq, self.capacity)
        except ValueError as e:
            return clip(str(e))
        for s in header.slots if self.mine(header) else ():
            end = self.covered.get(chunk_key(s))
            if end is not None and (s.start < end or not s.nbytes):
                return (f"tensor {s.name!r} is named twice in update {self.version} (bytes "
                        f"[{s.start}, {s.start + s.nbytes}) of it came in an earlier bucket)")
        return None


    def _blocks_rule(self, header: BucketHeader) -> str | None:
        """Which rule of blocks (`Slot.blocks`) header `header`, for this worker, breaks."""
        for s in header.slots:
            named = self.regions.get(s.name)
            if s.blocks is None:
                if named:
                    return f"tensor {s.name!r} comes whole after blocks of it"
                continue
            if not self.opening:
                return f"blocks of tensor {s.name!r} outside a plan's headers"
            if (why := self._outside(s)) is not None:
                return why
            first = chunk_key(s) not in self.covered
            if first and s.start:
                return f"blocks of tensor {s.name!r} begin at byte {s.start}, not 0"
            if first and any(overlaps(a, b) for a in s.blocks for b in named or ()):
                return f"blocks of tensor {s.name!r} named twice"
            if s.name in self.covered:
                return f"blocks of tensor {s.name!r} after the whole of it"
        return None

    def _outside(self, s: Slot) -> str | None:
        """Which block of `s` this worker does not read (None: it reads all of them)."""
        read = (self.reads or {}).get(s.name)
        if read is None:
            return (f"blocks of tensor {s.name!r}, of which this worker published no read"
                    if self.reads is not None else
                    f"blocks of tensor {s.name!r}, and this worker published no read set")
        if (read.dtype, read.shape) != (s.dtype, s.shape):
            return (f"blocks of tensor {s.name!r} as {s.dtype}{s.shape}, which this worker "
                    f"reads as {read.dtype}{read.shape}")
        for b in s.blocks or ():
            if not any(inside(b, r) for r in read.blocks):
                return (f"block {b.start}..{b.stop} of tensor {s.name!r} is not one this "
                        "worker reads")
        return None


def joined(problems: list[Problem]) -> str:
    """The texts of `problems`, in one line."""
    return "; ".join(p.text for p in problems)


def plan_problem(plan: Plan, rank: int, held: int, reference: Reference | None,
                 takes_adapters: bool) -> Problem | None:
    """Why receiver `rank`, holding version `held` of the plan's target, refuses `plan` before
    looking at its headers (None if it takes it): `Kind.MODEL` where its tensors disagree with
    the engine's model, else `Kind.PLAN`."""
    seen: set[str] = set()
    for t in plan.tensors:
        if t.name in seen:
            return Problem(Kind.PLAN, f"rank {rank} refused update {plan.version}: tensor "
                           f"{t.name!r} is named twice in the plan")
        seen.add(t.name)
    what = "" if plan.adapter is None else f" of adapter {plan.adapter.name!r}"
    if plan.version <= held and not plan.force:
        return Problem(Kind.PLAN, f"rank {rank} refused update {plan.version}{what}: it holds "
                       f"{held_weights(held)} (push with force=True to go back)")
    if plan.adapter is not None:
        if not takes_adapters:
            return Problem(Kind.PLAN, f"rank {rank} refused adapter {plan.adapter.name!r}: this "
                           "engine takes no LoRA adapters (start it with enable_lora=True)")
        return None  # the adapter loader checks names and shapes in `begin`
    problems = reference.problems(plan.tensors, plan.full) if reference is not None else []
    if not problems:
        return None
    more = f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""
    return Problem(Kind.MODEL, clip(f"rank {rank} refused update {plan.version}: "
                                    + joined(problems[:5]) + more))
