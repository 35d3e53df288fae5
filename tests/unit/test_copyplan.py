"""`integrations.vllm.copyplan`: a loader's copies recorded once, replayed as plain copies after,
bit for
bit what the loader writes; any loader that computes, or writes outside the parameters, turns
replay off with the reason. Real vLLM engines replay in `tests/engine/test_vllm_engine.py`."""

from __future__ import annotations

import pytest
import torch

from vllm_nccl_sync.integrations.vllm.copyplan import CopyPlan
from vllm_nccl_sync.wire import cuda_sums


class Toy(torch.nn.Module):
    """Loaders in the shapes vLLM's take: stacked shards (q, k, v into one qkv), a transposed
    copy, a padded embedding whose padding is filled, an integer buffer, and a tensor skipped."""

    def __init__(self, computed: bool = False, outside: bool = False) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(12, 4))
        self.proj = torch.nn.Parameter(torch.zeros(4, 6))
        self.embed = torch.nn.Parameter(torch.full((10, 4), 7.0))
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
        self.side = torch.zeros(4)  # not a parameter or buffer
        self.computed, self.outside = computed, outside
        self.calls = 0

    @torch.no_grad()
    def load_weights(self, weights):
        done = set()
        for name, w in weights:
            self.calls += 1
            if name in ("q", "k", "v"):
                self.qkv.data.narrow(0, 4 * "qkv".index(name), 4).copy_(w)
                done.add("qkv")
            elif name == "proj_t":
                self.proj.data.copy_(w.t() * 2 if self.computed else w.t())
                done.add("proj")
            elif name == "embed":
                self.embed.data[: w.shape[0]].copy_(w)
                self.embed.data[w.shape[0]:].fill_(0)
                if self.outside:
                    self.side.copy_(w[0])
                done.add("embed")
            elif name == "steps":
                self.steps.copy_(w)
                done.add("steps")
        return done


def weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    arena = torch.empty(1000)  # one arena, as the shadow holds them: views at offsets
    out, at = [], 0
    for name, shape in [("q", (4, 4)), ("k", (4, 4)), ("v", (4, 4)), ("proj_t", (6, 4)),
                        ("embed", (8, 4)), ("rotary.inv_freq", (2,))]:
        n = torch.Size(shape).numel()
        t = arena[at:at + n].view(shape)
        t.copy_(torch.randn(shape, generator=g))
        out.append((name, t))
        at += n + 3
    out.append(("steps", torch.randint(0, 2**40, (3,), generator=g)))
    return out


def state(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items()}


def params(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(m.named_parameters()), **dict(m.named_buffers())}


def update(plan: CopyPlan, m: Toy, seed: int) -> set[str]:
    plan.refresh(params(m))
    return plan.load(weights(seed), m.load_weights)


def test_replayed_loads_equal_the_loaders_own_and_skip_it():
    m, ref, plan = Toy(), Toy(), CopyPlan()
    assert update(plan, m, 1) == {"qkv", "proj", "embed", "steps"}
    assert m.calls == 7 and plan.replayed == 0 and not plan.off
    ptrs = {n: p.data_ptr() for n, p in params(m).items()}
    for seed in (2, 3):
        m.embed.data.fill_(5)  # the padding must be written again
        assert update(plan, m, seed) == {"qkv", "proj", "embed", "steps"}
        ref.load_weights(weights(seed))
        assert m.calls == 7  # replayed: the loader did not run again
        for name, want in state(ref).items():
            assert torch.equal(state(m)[name], want), name
    assert plan.replayed == 14
    assert ptrs == {n: p.data_ptr() for n, p in params(m).items()}  # in place


class Hooked(torch.nn.Parameter):
    """A parameter class like vLLM's: every method and attribute goes through its
    `__torch_function__` (counted here), which only defers to torch's."""

    calls = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        Hooked.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_replay_skips_the_parameters_own_hooks_and_stays_bit_exact():
    m, ref, plan = Toy(), Toy(), CopyPlan()
    for name in ("qkv", "proj", "embed"):
        setattr(m, name, Hooked(getattr(m, name).detach().clone(), requires_grad=False))
    update(plan, m, 1)  # recorded through the loader, which runs the hooks
    assert Hooked.calls > 0 and not plan.off
    for seed in (2, 3):
        Hooked.calls = 0
        assert update(plan, m, seed) == {"qkv", "proj", "embed", "steps"}
        assert Hooked.calls == 0 and m.calls == 7  # replayed, no hook run
        ref.load_weights(weights(seed))
        for name, want in state(ref).items():
            assert torch.equal(state(m)[name], want), name


def test_a_loader_that_computes_turns_replay_off_and_still_loads():
    m, ref, plan = Toy(computed=True), Toy(computed=True), CopyPlan()
    update(plan, m, 1)
    assert "proj" in plan.off and "another tensor than the one loaded" in plan.off
    update(plan, m, 2)
    ref.load_weights(weights(2))
    assert m.calls == 14 and plan.replayed == 0
    assert all(torch.equal(state(m)[n], v) for n, v in state(ref).items())


def test_a_write_outside_the_parameters_turns_replay_off():
    m, plan = Toy(outside=True), CopyPlan()
    update(plan, m, 1)
    assert "not a parameter" in plan.off and "'embed'" in plan.off
    update(plan, m, 2)
    assert m.calls == 14 and torch.equal(m.side, dict(weights(2))["embed"][0])


def test_a_replaced_parameter_or_another_shape_is_loaded_again():
    m, plan = Toy(), CopyPlan()
    update(plan, m, 1)
    m.proj = torch.nn.Parameter(torch.zeros(4, 6))  # e.g. a layer re-created for loading
    update(plan, m, 2)
    assert m.calls == 8 and torch.equal(m.proj, dict(weights(2))["proj_t"].t())
    m.calls = 0
    batch = [(n, t) for n, t in weights(3) if n != "embed"] + [("embed", torch.ones(6, 4))]
    plan.refresh(params(m))
    plan.load(batch, m.load_weights)  # embed's shape differs from the recorded one
    assert m.calls == 1 and torch.equal(m.embed, torch.cat([torch.ones(6, 4), torch.zeros(4, 4)]))
    assert plan.replayed == 6 + 6  # update 2: all but proj; update 3: all but embed


def test_a_parameter_viewing_its_storage_elsewhere_is_loaded_again():
    """The same Parameter over the same storage, at another offset: the recorded writes (at
    the old offset) are not replayed; the loader writes where the parameter lies now."""
    m, plan = Toy(), CopyPlan()
    base = torch.zeros(16, 4)
    m.qkv = torch.nn.Parameter(base[:12])
    update(plan, m, 1)
    m.qkv.data = base[4:]
    update(plan, m, 2)
    assert m.calls == 10 and torch.equal(m.qkv, torch.cat([w for _, w in weights(2)[:3]]))


def test_a_parameter_made_anew_each_update_replays_where_its_layout_is_the_same():
    """A parameter the loader's `begin` makes anew for each update (vLLM's CPU linears), named
    `renewed`: its recorded copies replay into the new object, bit for bit what the loader
    writes; made anew with another shape, or not named renewed, it goes through the loader."""
    m, ref, plan = Toy(), Toy(), CopyPlan()

    def renew(shape: tuple[int, int] = (12, 4)) -> None:
        m.qkv = torch.nn.Parameter(torch.full(shape, float("nan")))  # as `cpu_repack` makes it

    renew()
    plan.refresh(params(m), frozenset({"qkv"}))
    plan.load(weights(1), m.load_weights)
    assert m.calls == 7 and plan.loaded == 7 and not plan.off
    for seed in (2, 3):
        renew()
        plan.refresh(params(m), frozenset({"qkv"}))
        assert plan.load(weights(seed), m.load_weights) == {"qkv", "proj", "embed", "steps"}
        ref.load_weights(weights(seed))
        assert m.calls == 7 and plan.loaded == 7  # q, k, v replayed into the new qkv
        assert all(torch.equal(state(m)[n], v) for n, v in state(ref).items())
    assert plan.replayed == 14
    renew()
    plan.refresh(params(m))  # not named renewed: another Parameter, loaded again
    plan.load(weights(4), m.load_weights)
    assert m.calls == 10 and torch.equal(m.qkv, torch.cat([w for n, w in weights(4)[:3]]))
    renew((13, 4))  # renewed, but its layout is not the recorded one
    plan.refresh(params(m), frozenset({"qkv"}))
    plan.load(weights(5), m.load_weights)
    assert m.calls == 13 and torch.equal(m.qkv[:12], torch.cat([w for n, w in weights(5)[:3]]))


def test_a_rehearsal_records_without_writing_and_the_first_load_replays():
    m, ref, plan = Toy(), Toy(), CopyPlan()
    before = state(m)
    plan.refresh(params(m))
    assert plan.rehearse(weights(1), m.load_weights) == 7  # every tensor but the skipped one
    assert m.calls == 7 and not plan.off
    assert all(torch.equal(state(m)[n], v) for n, v in before.items())  # nothing written
    assert update(plan, m, 1) == {"qkv", "proj", "embed", "steps"}
    ref.load_weights(weights(1))
    assert m.calls == 7 and plan.replayed == 7  # the load itself: replayed only
    assert all(torch.equal(state(m)[n], v) for n, v in state(ref).items())


def test_a_rehearsal_of_a_loader_that_computes_or_fails_writes_nothing():
    m, plan = Toy(computed=True), CopyPlan()
    before = state(m)
    plan.refresh(params(m))
    plan.rehearse(weights(1), m.load_weights)
    assert "proj" in plan.off  # as a real load would find, and still nothing written
    assert all(torch.equal(state(m)[n], v) for n, v in before.items())

    class Failing(Toy):  # loading "embed" raises (e.g. its parameter is re-created first)
        def load_weights(self, weights):
            def checked():
                for n, w in weights:
                    if n == "embed":
                        raise ValueError("not in this layout yet")
                    yield n, w

            return super().load_weights(checked())

    m, plan = Failing(), CopyPlan()
    before = state(m)
    plan.refresh(params(m))
    assert plan.rehearse(weights(1), m.load_weights) == 6 and not plan.off  # all but embed
    assert "embed" not in plan.entries and "proj_t" in plan.entries
    assert all(torch.equal(state(m)[n], v) for n, v in before.items())


def test_a_rehearsal_that_replaces_a_parameters_storage_is_undone():
    class Replacing(Toy):
        def load_weights(self, weights):
            self.proj.data = torch.ones(4, 6)  # no ATen op: nothing sees it but the check after
            return super().load_weights(weights)

    m, plan = Replacing(), CopyPlan()
    held = m.proj.data_ptr()
    plan.refresh(params(m))
    assert plan.rehearse(weights(1), m.load_weights) == 0
    assert "'proj'" in plan.off and m.proj.data_ptr() == held and not m.proj.any()


def test_replayed_writes_that_overlap_keep_their_order():
    class Overlap(torch.nn.Module):  # "b" overwrites part of what "a" wrote
        def __init__(self) -> None:
            super().__init__()
            self.p = torch.nn.Parameter(torch.zeros(8))

        @torch.no_grad()
        def load_weights(self, weights):
            for name, w in weights:
                (self.p.data[0:6] if name == "a" else self.p.data[4:8]).copy_(w)
            return {"p"}

    m, plan = Overlap(), CopyPlan()
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        batch = [("a", torch.randn(6, generator=g)), ("b", torch.randn(4, generator=g))]
        plan.refresh(params(m))
        plan.load(batch, m.load_weights)
        assert torch.equal(m.p, torch.cat([batch[0][1][:4], batch[1][1]]))
    assert plan.replayed == 2


@pytest.mark.gpu
def test_a_replay_tapped_by_a_receiver_copies_bit_exact_and_hands_over_each_checksum():
    """On CUDA, whole copies of tensors a receiver taps go through one `copy_summed` launch:
    the parameters are what the loader writes, and each tapped tensor's checksum terms equal
    the formula's over its bytes (what the receiver would have summed itself)."""
    from vllm_nccl_sync.wire.integrity import _terms, checksum_parts_gpu, read_back
    from vllm_nccl_sync.wire.taps import Tap, tapping

    if cuda_sums.triton is None:
        pytest.skip("Triton is not installed")
    m, ref = Toy().cuda(), Toy().cuda()
    plan = CopyPlan()
    plan.refresh(params(m))
    plan.load([(n, t.cuda()) for n, t in weights(1)], m.load_weights)  # records
    named = [(n, t.cuda()) for n, t in weights(2)]
    ref.load_weights(named)
    tap = Tap()
    parts = [t.reshape(-1).view(torch.uint8) for _, t in named]
    for p in parts:
        tap.want(p)
    token = tapping.set(tap)
    try:
        plan.load(named, m.load_weights)
    finally:
        tapping.reset(token)
    assert all(torch.equal(a, b) for a, b in zip(state(m).values(), state(ref).values()))
    summed = [tap.take(p) for p in parts]
    assert summed[0] is not None  # q: a whole, aligned copy into its slice of qkv
    assert summed[3] is None  # proj_t is copied transposed: not a whole copy
    assert read_back([checksum_parts_gpu(parts, summed)]) == read_back(
        [checksum_parts_gpu(parts, [_terms(p) for p in parts])])


def _tapped_update(plan: CopyPlan, m: Toy, named: list[tuple[str, torch.Tensor]]
                   ) -> tuple[list[torch.Tensor], list]:
    """One update of `m` from `named` with a receiver's tap on every tensor: the parts and
    the terms the copies handed over."""
    from vllm_nccl_sync.wire.taps import Tap, tapping

    tap, parts = Tap(), [t.reshape(-1).view(torch.uint8) for _, t in named]
    for p in parts:
        tap.want(p)
    plan.refresh(params(m))
    token = tapping.set(tap)
    try:
        plan.load(named, m.load_weights)
    finally:
        tapping.reset(token)
    return parts, [tap.take(p) for p in parts]


def test_a_replay_tapped_on_the_host_copies_bit_exact_and_hands_over_each_checksum():
    """On the host (the `shm` plane read in place) the whole copies of tapped tensors go
    through the host's summing copy: the parameters are what the loader writes, and each
    tapped tensor's checksum equals the formula's over its bytes."""
    from vllm_nccl_sync.wire.integrity import checksum_parts

    m, ref = Toy(), Toy()
    plan = CopyPlan()
    plan.refresh(params(m))
    plan.load(weights(1), m.load_weights)  # records
    named = [(n, t.clone()) for n, t in weights(2)]  # each aligned, as a trainer's
    ref.load_weights(named)
    parts, summed = _tapped_update(plan, m, named)
    assert all(torch.equal(a, b) for a, b in zip(state(m).values(), state(ref).values()))
    assert summed[0] is not None and summed[3] is None  # q whole; proj_t transposed
    assert checksum_parts(parts, summed) == checksum_parts(parts)


@pytest.mark.gpu
def test_a_replay_that_repeats_is_one_graph_launch_bit_exact_and_never_stale():
    """The third update of one layout (recorded, replayed, then captured) and every later one
    is a graph launch: the parameters are what the loader writes and the tapped checksums equal
    the formula's. A replaced parameter or sources elsewhere are never written through an old
    graph: they go by the loader or as plain copies, bit exact."""
    from vllm_nccl_sync.wire.integrity import _terms, checksum_parts_gpu, read_back

    if cuda_sums.triton is None:
        pytest.skip("Triton is not installed")
    m, ref = Toy().cuda(), Toy().cuda()
    plan = CopyPlan()
    named = [(n, t.cuda()) for n, t in weights(1)]  # the trainer's tensors, refilled in place
    for seed in range(1, 6):
        for (_, dst), (_, src) in zip(named, weights(seed), strict=True):
            dst.copy_(src)
        m.embed.data.fill_(5)  # the padding must be written again
        ref.load_weights(named)
        parts, summed = _tapped_update(plan, m, named)
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(state(m).values(), state(ref).values()))
        assert (summed[0] is not None) == (seed > 1)  # seed 1 goes through the loader
        assert read_back([checksum_parts_gpu(parts, summed)]) == read_back(
            [checksum_parts_gpu(parts, [_terms(p) for p in parts])]), seed
    assert (plan.graphs.launched, m.calls, plan.graphs.off) == (3, 7, "")

    old = m.proj.data  # a parameter re-created in another storage
    m.proj.data = torch.zeros_like(old)
    kept = old.clone()
    for seed in (8, 9):  # sources at other addresses each time
        batch = [(n, t.cuda()) for n, t in weights(seed)]
        plan.refresh(params(m))
        plan.load(batch, m.load_weights)
        ref.load_weights(batch)
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(state(m).values(), state(ref).values()))
        assert torch.equal(old, kept)  # the old storage was not written through a graph
    assert plan.graphs.launched == 3
