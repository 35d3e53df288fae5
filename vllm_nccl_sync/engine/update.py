"""The book-keeping of one update on one receiver, and the checks of its plan and headers.

A plan is accepted or refused as a whole: every header it carries is checked before the one
`Ready` (or `Error`) that answers it. A stream's later headers are checked one by one. Across the
plan's tensor list and every header of the update, stream headers included, each tensor (or each
byte range of a tensor cut over several buckets) is named once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_nccl_sync.engine.handshake import Reference
from vllm_nccl_sync.engine.residency import Residency
from vllm_nccl_sync.engine.state import ReceiverState, held_weights
from vllm_nccl_sync.outcomes import clip
from vllm_nccl_sync.wire.packing import validate_header
from vllm_nccl_sync.wire.protocol import AdapterSpec, BucketHeader, Plan, TensorSpec, belongs


@dataclass(slots=True)
class Update:
    """The update in progress on receiver `rank` (buckets of at most `capacity` bytes, from
    `senders` senders)."""

    rank: int
    capacity: int
    senders: int = 1
    version: int = -1
    runs: bool = True
    """The plane's loads read buckets read in place where they lie (valid all update), so a run
    of them goes to the loader in one call; False where each is copied into a reused buffer."""
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
    covered: dict[str, int] = field(default_factory=dict)
    """Per tensor named so far: where the bytes named for it end."""
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
    failed: str | None = None
    began: bool = False
    exposed: bool = False
    """Data of this update may have been loaded by some worker: a failure now leaves it mixed."""
    in_step: bool = True
    """Every collective this receiver agreed to was joined (the group stays usable)."""
    sums: list[Any] = field(default_factory=list)
    """Per bucket: the checksum of what arrived (an int, or one queued on the device)."""
    staged_tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    batch: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    """Tensors of consecutive buckets read in place, handed to the loader in one call."""
    adapter: AdapterSpec | None = None
    """The LoRA adapter this update targets (None: base weights)."""
    beside: Any = None
    """`shadow.BesideReceive` of an update received beside serving (None: paused)."""
    held: Residency | None = None
    """The model's `engine.residency` record when this update must rewrite every weight to
    commit (its `discarded` says why; None: it need not)."""
    named: dict[str, TensorSpec] = field(default_factory=dict)
    """Every tensor the update's headers named (kept when it must rewrite every weight)."""
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

    def open(self, plan: Plan, reference: Reference | None) -> str:
        """Check every header `plan` carries (the update's version and staged flag already
        taken from it): all of them are accepted, or none (the refusal: the first problem)."""
        if plan.adapter is None:
            self.reference = reference
            self.plan_tensors = {t.name: t for t in plan.tensors}
        if not plan.buckets:
            return f"rank {self.rank} refused update {plan.version}: a plan without buckets"
        for h in plan.buckets:
            problem = (f"rank {self.rank} rejected bucket {h.seq}: force flag differs from the "
                       "plan's") if h.force != plan.force else self.accept(h)
            if problem:
                self.refuse(problem)
                return problem
        return ""

    def refuse(self, problem: str) -> None:
        """Record the refusal of the whole plan, whichever check refused it: no header is
        accepted, so no `Go` is agreement (a `Go` for any bucket is one nobody here joins)."""
        self.headers, self.accepted, self.last, self.refused = {}, -1, -1, 0
        if self.failed is None:
            self.failed = problem

    def accept(self, header: BucketHeader) -> str:
        """Check the next header; on success remember it, else record the refusal."""
        seq = self.accepted + 1
        problem = self.failed or self._problem(header, seq)
        if problem:
            if self.refused < 0:
                self.refused = seq
            if self.failed is None:
                self.failed = problem
            return problem
        for s in header.slots:
            self.covered[s.name] = max(self.covered.get(s.name, 0), s.start + s.nbytes)
            if self.held is not None:
                self.named.setdefault(s.name, TensorSpec(s.name, s.dtype, s.shape))
        self.headers[seq] = header
        self.accepted = seq
        if header.is_last:
            self.last = seq
        return ""

    def residency_problem(self, plan: Plan, residency: Callable[[], Residency] | None,
                          reference: Reference | None) -> str:
        """Why the engine's sleep state (`engine.residency`; None: not known) refuses `plan`
        ("" if it does not). Weights asleep: refused. Weights discarded: the update must rewrite
        every weight (`held`); a state-dict plan must name every checkpoint tensor now, a
        stream by its commit."""
        if residency is None:
            return ""
        r = residency()
        where = f"rank {self.rank} refused update {plan.version}"
        if r.unwritable:
            return f"{where}: {r.unwritable}"
        if not r.discarded or plan.adapter is not None:
            return ""
        if reference is None:
            return (f"{where}: {r.discarded}, and without the engine's checkpoint headers it "
                    "cannot check that the update rewrites every weight")
        self.held = r
        missing = reference.problems(plan.tensors, full=True) if plan.tensors else []
        return f"{where}: {r.discarded}; {self.rewrite_needed(missing)}" if missing else ""

    def batched(self, named: list[tuple[str, torch.Tensor]],
                header: BucketHeader) -> list[tuple[str, torch.Tensor]] | None:
        """`named` added to the tensors waiting for the loader: all of them to load now, or None
        while a run of buckets read in place goes on (one loader call for the run, where `runs`)."""
        self.batch += named
        after = self.headers.get(header.seq + 1)
        if self.runs and header.at is not None and after is not None and after.at is not None:
            return None
        ready, self.batch = self.batch, []
        return ready

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

    def rewrite_needed(self, missing: list[str]) -> str:
        return f"every weight must be rewritten, but {'; '.join(missing)}"

    def coverage_problem(self, loader: Any) -> str:
        """Why this update, loaded and finished, may not commit because it must rewrite every
        weight and did not ("" if it may): a checkpoint tensor no header named, or a parameter
        the loaders wrote nothing into (`loader.unwritten()`, where the loader can tell)."""
        if self.held is None or self.reference is None:
            return ""
        where = f"rank {self.rank} refused to commit update {self.version}: {self.held.discarded}"
        missing = self.reference.problems(list(self.named.values()), full=True)
        if missing:
            return clip(f"{where}; {self.rewrite_needed(missing)}")
        unwritten = getattr(loader, "unwritten", None)
        left = unwritten() if unwritten is not None else None
        if left:
            shown = ", ".join(sorted(left)[:8]) + (" ..." if len(left) > 8 else "")
            return clip(f"{where}; every weight must be rewritten, but the loaders wrote "
                        f"nothing into {len(left)} parameter(s): {shown}")
        return ""

    def _problem(self, header: BucketHeader, seq: int) -> str:
        """Why this receiver refuses header `seq` ("" if it accepts it)."""
        where = f"rank {self.rank} rejected bucket {seq}"
        if not belongs(header, self.version):  # a header nested in the plan
            return f"header of update {header.version} in update {self.version}"
        if header.staged != self.staged:
            return f"{where}: staged flag differs from the plan's"
        if self.last >= 0:
            return f"{where}: it follows the last bucket {self.last}"
        if not 0 <= header.src < self.senders:
            return f"{where}: sender {header.src} is not one of the {self.senders} sender(s)"
        try:
            validate_header(header, seq, self.capacity)
        except ValueError as e:
            return f"{where}: {clip(str(e))}"
        for s in header.slots:
            end = self.covered.get(s.name)
            if end is not None and (s.start < end or not s.nbytes):
                return (f"{where}: tensor {s.name!r} is named twice in update {self.version} "
                        f"(bytes [{s.start}, {s.start + s.nbytes}) of it came in an earlier "
                        "bucket)")
        specs = [TensorSpec(x.name, x.dtype, x.shape) for x in header.slots]
        problems = []
        if self.plan_tensors:
            problems = [f"tensor {x.name!r} ({x.dtype} {x.shape}) is not the plan's"
                        for x in specs if self.plan_tensors.get(x.name) != x]
        if not problems and self.reference is not None:
            problems = self.reference.problems(specs)
        if problems:
            return f"{where}: " + clip("; ".join(problems[:5]))
        return ""


def plan_problem(plan: Plan, rank: int, held: int, reference: Reference | None,
                 takes_adapters: bool) -> str:
    """Why receiver `rank`, holding version `held` of the plan's target, refuses `plan` before
    looking at its headers ("" if it takes it)."""
    seen: set[str] = set()
    for t in plan.tensors:
        if t.name in seen:
            return (f"rank {rank} refused update {plan.version}: tensor {t.name!r} is named "
                    "twice in the plan")
        seen.add(t.name)
    what = "" if plan.adapter is None else f" of adapter {plan.adapter.name!r}"
    if plan.version <= held and not plan.force:
        return (f"rank {rank} refused update {plan.version}{what}: it holds {held_weights(held)} "
                "(push with force=True to go back)")
    if plan.adapter is not None:
        if not takes_adapters:
            return (f"rank {rank} refused adapter {plan.adapter.name!r}: this engine takes no "
                    "LoRA adapters (start it with enable_lora=True)")
        return ""  # the adapter loader checks names and shapes in `begin`
    if reference is None:
        return ""
    problems = reference.problems(plan.tensors, plan.full)
    if not problems:
        return ""
    more = f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""
    return clip(f"rank {rank} refused update {plan.version}: " + "; ".join(problems[:5]) + more)
