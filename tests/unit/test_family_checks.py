"""The family matrix's checks that need no engine: the plan check through a model's name mapping,
hub-cache ids, block-FP8 (plan check and the engine-side quantization, bit for bit), `verify`'s
rebuilding of vLLM's parameter layouts, and the refusal of a model-level post-load hook.
`tests/engine/test_families.py` runs the families on real engines."""

from __future__ import annotations

import os

from vllm_nccl_sync.tiny import build_model, save_model


def _vlm_mapping(name: str) -> str | None:
    """Qwen2-VL's `hf_to_vllm_mapper` prefixes, as vLLM applies them (first match wins)."""
    for old, new in (("model.language_model.", "language_model.model."),
                     ("model.visual.", "visual."), ("lm_head.", "language_model.lm_head."),
                     ("model.", "language_model.model.")):
        if name.startswith(old):
            return new + name[len(old):]
    return None if name.startswith("junk.") else name


def test_plan_check_goes_through_the_models_name_mapping():
    """Every spelling the loader maps to a checkpoint tensor passes; a name it drops, or maps to
    nothing the checkpoint has, is refused with the reason; shapes still count."""
    from vllm_nccl_sync.engine.handshake import Reference
    from vllm_nccl_sync.wire.protocol import TensorSpec

    ref = Reference({"model.layers.0.mlp.down_proj.weight": ("float32", [8, 4]),
                     "model.embed_tokens.weight": ("float32", [16, 8])},
                    {"lm_head.weight": "model.embed_tokens.weight"}, set(), _vlm_mapping)

    def problems(name: str, shape=(8, 4)) -> list[str]:
        return [p.text for p in ref.problems([TensorSpec(name=name, dtype="float32",
                                                         shape=list(shape))])]

    assert problems("model.layers.0.mlp.down_proj.weight") == []
    assert problems("model.language_model.layers.0.mlp.down_proj.weight") == []
    assert problems("lm_head.weight", (16, 8)) == []
    assert "shape" in problems("model.language_model.layers.0.mlp.down_proj.weight", (4, 8))[0]
    assert "drops this name" in problems("junk.layers.0.weight")[0]
    assert "no such weight" in problems("model.language_model.layers.9.mlp.down_proj.weight")[0]


def test_hub_cache_model_id_is_read_like_a_directory(tmp_path, monkeypatch):
    """A model id whose snapshot is in the local hub cache gives the same reference as the
    directory; an id not in the cache gives none (and never downloads)."""
    from vllm_nccl_sync.engine.handshake import checkpoint_reference

    src = save_model(build_model("qwen3", 1), str(tmp_path / "src"))
    cache = tmp_path / "hub"
    snap = cache / "models--acme--tiny-qwen3" / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    for f in ("config.json", "model.safetensors"):
        (snap / f).symlink_to(os.path.join(src, f))
    (cache / "models--acme--tiny-qwen3" / "refs").mkdir()
    (cache / "models--acme--tiny-qwen3" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    by_id = checkpoint_reference("acme/tiny-qwen3", False, "float32")
    by_dir = checkpoint_reference(src, False, "float32")
    assert by_id is not None and by_id.tensors == by_dir.tensors and len(by_id.tensors) > 10
    assert checkpoint_reference("acme/not-cached", False, "float32") is None


def test_fp8_checkpoints_take_what_the_engine_can_load():
    """Block-FP8 (weights + `weight_scale_inv`): FP8 + scales pass, and so does bf16 (the engine
    quantizes it as the checkpoint was made, scale included, so a full update needs no scales).
    An FP8 weight with a per-tensor scale refuses bf16, saying what to send instead."""
    import torch

    from vllm_nccl_sync.engine.handshake import Reference
    from vllm_nccl_sync.integrations.vllm.block_fp8 import expand, quantize
    from vllm_nccl_sync.wire.protocol import TensorSpec

    w = "model.layers.0.mlp.down_proj.weight"
    ref = Reference({w: ("float8_e4m3fn", [128, 256]), w + "_scale_inv": ("float32", [1, 2]),
                     "model.norm.weight": ("bfloat16", [128])}, {}, {"bfloat16"})
    fp8 = [TensorSpec(name=w, dtype="float8_e4m3fn", shape=[128, 256]),
           TensorSpec(name=w + "_scale_inv", dtype="float32", shape=[1, 2])]
    bf16 = [TensorSpec(name=w, dtype="bfloat16", shape=[128, 256]),
            TensorSpec(name="model.norm.weight", dtype="bfloat16", shape=[128])]
    assert ref.problems(fp8) == [] and ref.problems(bf16, full=True) == []

    t = torch.randn(128, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    [(n1, q), (n2, scale)] = expand([(w, t)], {w: (128, 128)})
    assert (n1, n2, q.dtype, list(scale.shape)) == (w, w + "_scale_inv", torch.float8_e4m3fn,
                                                   [1, 2])
    assert torch.equal(q, quantize(t, (128, 128))[0])
    back = (q.float().reshape(1, 128, 2, 128) * scale[:, None, :, None]).reshape(128, 256)
    assert (back - t.float()).abs().max() <= 0.07 * t.float().abs().max()

    per_tensor = Reference({w: ("float8_e4m3fn", [128, 256]), w + "_scale": ("float32", [])},
                           {}, {"bfloat16"})
    [problem] = per_tensor.problems(bf16[:1])
    why = problem.text
    assert "scale" in why and "quantization='fp8'" in why


def _bits(t) -> bytes:
    """The tensor's bytes, to compare FP8 and float tensors bit for bit."""
    import torch

    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_block_fp8_quantization_is_the_checkpoint_makers_bit_for_bit(tmp_path):
    """The engine-side quantization of bf16 (`expand`) gives exactly the tensors of the block-FP8
    checkpoint made from the same weights, and equals a float64 reference of the formula
    (scale_inv = amax / 448 correctly rounded, fp8 = RNE(w / scale_inv)), which no device changes.
    Negative control: multiplying by the rounded reciprocal of 448 (what CUDA does for `x / 448.0`)
    moves scales and FP8 values, so this check would see that difference."""
    import torch

    from tests.helpers import FP8_BLOCK, make_block_fp8
    from vllm_nccl_sync.integrations.vllm.block_fp8 import FP8_MAX, SCALE, blocks_of, expand, quantize
    from vllm_nccl_sync.verify import checkpoint_tensors

    fp8 = {n: f() for n, f in checkpoint_tensors(make_block_fp8(str(tmp_path / "q"), 3)).items()}
    bf16 = checkpoint_tensors(make_block_fp8(str(tmp_path / "b"), 3, quantized=False))
    index = {n: (str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in fp8.items()}
    blocks = blocks_of(index, [FP8_BLOCK, FP8_BLOCK])
    assert len(blocks) == 14
    got = dict(expand([(n, f()) for n, f in bf16.items()], blocks))
    assert got.keys() == fp8.keys()
    for n, t in fp8.items():
        assert got[n].dtype == t.dtype and _bits(got[n]) == _bits(t), n
        if n in blocks:
            assert t.dtype == torch.float8_e4m3fn and fp8[n + SCALE].dtype == torch.float32

    def reference(w: torch.Tensor, recip: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        rows, cols = w.shape[0] // FP8_BLOCK, w.shape[1] // FP8_BLOCK
        b = w.double().reshape(rows, FP8_BLOCK, cols, FP8_BLOCK)
        amax = b.abs().amax(dim=(1, 3))
        scale = ((amax.float() * (torch.tensor(1.0) / FP8_MAX)) if recip
                 else (amax / FP8_MAX).float())
        q = (b / scale.double()[:, None, :, None]).float().reshape(w.shape)
        return q.to(torch.float8_e4m3fn), scale

    moved = 0
    for n in blocks:
        w = bf16[n]()
        q, s = quantize(w, (FP8_BLOCK, FP8_BLOCK))
        rq, rs = reference(w)
        assert _bits(s) == _bits(rs) and _bits(q) == _bits(rq), n
        cq, cs = reference(w, recip=True)
        moved += (_bits(cs) != _bits(s)) + (_bits(cq) != _bits(q))
    assert moved > 0, "the reciprocal control moved nothing: the check is blind"


def test_verify_finds_a_vlms_packed_modules_on_its_language_model():
    """A VLM declaring no `packed_modules_mapping` of its own (vLLM's `SupportsLoRA` default) while
    its language model declares `qkv_proj`: `verify` rebuilds the stacked parameter from the
    checkpoint's q/k/v under the mapper's names, and every engine parameter has its sources."""
    import torch

    from vllm_nccl_sync.verify import compare, module_checksums

    class Mapper:
        orig_to_new_prefix = {"model.language_model.": "language_model.model.",
                              "lm_head.": "language_model.lm_head.",
                              "model.": "language_model.model."}

    class Attn(torch.nn.Module):
        def __init__(self, q, k, v) -> None:
            super().__init__()
            self.qkv_proj = torch.nn.Linear(4, 12, bias=False)
            self.o_proj = torch.nn.Linear(4, 4, bias=False)
            with torch.no_grad():
                self.qkv_proj.weight.copy_(torch.cat([q, k, v]))

    class LM(torch.nn.Module):
        packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

        def __init__(self, attn: torch.nn.Module) -> None:
            super().__init__()
            self.model = torch.nn.Module()
            self.model.layers = torch.nn.ModuleList([torch.nn.Module()])
            self.model.layers[0].self_attn = attn

    class VLM(torch.nn.Module):
        packed_modules_mapping: dict[str, list[str]] = {}
        hf_to_vllm_mapper = Mapper()

        def __init__(self, lm: torch.nn.Module) -> None:
            super().__init__()
            self.language_model = lm

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 4, generator=g) for _ in range(3))
    engine = VLM(LM(Attn(q, k, v)))
    o = engine.language_model.model.layers[0].self_attn.o_proj.weight.detach().clone()
    pre = "model.layers.0.self_attn."
    src = {pre + "q_proj.weight": q, pre + "k_proj.weight": k, pre + "v_proj.weight": v,
           pre + "o_proj.weight": o}
    report = compare(src, [{"params": module_checksums(engine)}])
    assert report.count("match") == 4 and not report.engine_only, report.to_dict()
    stale = compare({**src, pre + "k_proj.weight": k + 1}, [{"params": module_checksums(engine)}])
    assert stale.count("mismatch") == 3, stale.summary()


def test_verify_rebuilds_stacked_sharded_padded_and_expert_parameters():
    """`compare` rebuilds each engine parameter from the checkpoint the way vLLM's loaders lay it
    out (stacked q|k|v under TP, a vocabulary padded then sharded, fused experts), so a TP-2
    engine is compared in full; one changed element is a mismatch on the rank that holds it."""
    import torch

    from vllm_nccl_sync.verify import compare, digest

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(8, 4, generator=g) for _ in range(3))
    emb = torch.randn(10, 4, generator=g)
    gate, up = ([torch.randn(6, 4, generator=g) for _ in range(2)] for _ in range(2))
    src = {"m.q_proj.weight": q, "m.k_proj.weight": k, "m.v_proj.weight": v, "m.embed.weight": emb,
           **{f"m.experts.{e}.gate_proj.weight": gate[e] for e in range(2)},
           **{f"m.experts.{e}.up_proj.weight": up[e] for e in range(2)}}

    def entry(t: torch.Tensor, **layout) -> dict:
        return {"dtype": "float32", "shape": list(t.shape), "numel": t.numel(),
                "sha256": digest(t), "note": "", **layout}

    def worker(rank: int, tp: int, qkv_edit: float = 0.0) -> dict:
        qkv = torch.cat([t.chunk(tp)[rank] for t in (q, k, v)])
        qkv[0, 0] += qkv_edit
        w13 = torch.stack([torch.cat([gate[e], up[e]]) for e in range(2)])
        rows = [[f"m.experts.{e}.{p}.weight"] for e in range(2) for p in ("gate_proj", "up_proj")]
        return {"tp_rank": rank, "tp_size": tp, "params": {
            "m.qkv_proj.weight": entry(qkv, parts=[[["m.qkv_proj.weight"]], [
                ["m.q_proj.weight"], ["m.k_proj.weight"], ["m.v_proj.weight"]]]),
            "m.embed.weight": entry(torch.cat([emb, torch.zeros(6, 4)]).chunk(tp)[rank],
                                    parts=[[["m.embed.weight"]]]),
            "m.experts.w13_weight": entry(w13, experts=rows)}}

    full = compare(src, [worker(0, 2), worker(1, 2)])
    assert full.count("match") == 2 * len(src) and full.ok, full.summary()
    assert not full.engine_only
    bad = compare(src, [worker(0, 2), worker(1, 2, qkv_edit=1.0)])
    assert {(e.name, e.worker) for e in bad.entries if e.status == "mismatch"} == {
        (f"m.{p}_proj.weight", 1) for p in "qkv"}


def test_model_with_its_own_post_load_hook_is_refused_with_the_reason():
    """A model-level `process_weights_after_loading` cannot be re-run in place: the loader says
    so when it is created (before any update), naming the model and what to do."""
    import torch

    from vllm_nccl_sync.integrations.vllm.patches.postload import unsupported

    class Plain(torch.nn.Module):
        pass

    class Hooked(torch.nn.Module):
        def process_weights_after_loading(self) -> None:
            pass

    assert unsupported(Plain()) is None
    why = unsupported(Hooked())
    assert "Hooked" in why and "Restart the engine" in why
