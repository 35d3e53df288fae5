"""Test-only vLLM worker extension for the model-family matrix: `LoaderExt` plus what the family
tests inspect inside the worker (derived tensors, the plan check, the per-layer rule)."""

from __future__ import annotations

from typing import Any

from tests.loader_ext import LoaderExt


class FamilyExt(LoaderExt):
    """Mixed into vLLM's worker class by `worker_extension_cls="tests.family_ext.FamilyExt"`."""

    def nccl_test_derived(self) -> dict[str, str]:
        """sha256 of every tensor a derived layer (MLA's `W_UK_T`/`W_UV`) holds, by name."""
        from vllm_nccl_sync.integrations.vllm.patches.postload import derived_layers, layer_tensors
        from vllm_nccl_sync.verify import digest

        return {f"{name}.{t}": digest(v) for name, (layer, _) in
                derived_layers(self.model_runner.model).items()
                for t, v in sorted(layer_tensors(layer).items()) if t.startswith("W_")}

    def nccl_test_try_load_dir(self, path: str, only: list[str]) -> str:
        """`nccl_test_load_dir` that returns the loader's error message ("" if none)."""
        try:
            self.nccl_test_load_dir(path, only=only)
        except ValueError as e:
            return str(e)
        return ""

    def nccl_test_checksums(self) -> dict[str, Any]:
        """What `Ext.nccl_sync_checksums` returns (one worker, TP 1)."""
        from vllm_nccl_sync.verify import module_checksums

        return {"tp_rank": 0, "tp_size": 1, "params": module_checksums(self.model_runner.model)}

    def nccl_test_state(self) -> dict[str, str]:
        """sha256 of every non-empty parameter as the engine holds it (re-laid-out experts as laid
        out)."""
        from vllm_nccl_sync.verify import digest, module_checksums

        model = self.model_runner.model
        out = {n: c["sha256"] for n, c in module_checksums(model).items()}
        for name, p in model.named_parameters(remove_duplicate=False):
            if not out.get(name) and p.numel():
                out[name] = digest(p)
        return out

    def nccl_test_mla_consistent(self) -> dict[str, bool]:
        """Per MLA layer: do `W_UK_T`/`W_UV` equal what `kv_b_proj` now holds, split the way
        vLLM's `MLAAttention.process_weights_after_loading` splits it?"""
        import torch
        from vllm.model_executor.layers.attention.mla_attention import split_kv_b_proj

        from vllm_nccl_sync.integrations.vllm.patches.postload import derived_layers

        out = {}
        for name, (m, _) in derived_layers(self.model_runner.model).items():
            w_uk, w_uv = split_kv_b_proj(m.kv_b_proj, m.W_UV.dtype, m.kv_lora_rank, m.num_heads,
                                         m.qk_nope_head_dim, m.v_head_dim)
            out[name] = bool(torch.equal(m.W_UV, w_uv.transpose(0, 1))
                             and torch.equal(m.W_UK_T, w_uk.permute(1, 2, 0)))
        return out

    def nccl_test_detach_derived(self) -> dict[str, bool]:
        """Give every MLA layer its own copies of `W_UK_T`/`W_UV`, as backends that dequantize or
        re-lay out `kv_b_proj` hold them; returns, per layer, whether they were views of
        `kv_b_proj`'s weight before (so could not go stale)."""
        import torch

        from vllm_nccl_sync.integrations.vllm.patches.postload import derived_layers

        out = {}
        for name, (m, _) in derived_layers(self.model_runner.model).items():
            base = m.kv_b_proj.weight.untyped_storage().data_ptr()
            out[name] = all(getattr(m, t).untyped_storage().data_ptr() == base
                            for t in ("W_UK_T", "W_UV"))
            for t in ("W_UK_T", "W_UV"):
                copy = torch.nn.Parameter(getattr(m, t).detach().clone(), requires_grad=False)
                m._parameters.pop(t, None)
                m.register_parameter(t, copy)
        return out

    def nccl_test_skip_derived(self, skip: bool) -> None:
        """Negative control: make the loader skip (or again run) the derived-tensor refresh."""
        from vllm_nccl_sync.integrations.vllm.patches import postload as postload_patch

        if not hasattr(postload_patch, "_real_refresh"):
            postload_patch._real_refresh = postload_patch.refresh_derived
        postload_patch.refresh_derived = ((lambda *a: 0) if skip
                                         else postload_patch._real_refresh)

    def nccl_test_rule(self) -> dict[str, Any]:
        """The per-layer rule as it applies to this model: kernel-format and derived layers."""
        from vllm_nccl_sync.integrations.vllm.patches.postload import derived_layers, transformed

        model = self.model_runner.model
        return {"transformed": transformed(model), "derived": sorted(derived_layers(model))}

    def nccl_test_plan_problems(self, specs: list[list[Any]]) -> list[str]:
        """What the engine's plan check says about `[[name, dtype, shape], ...]`."""
        from vllm_nccl_sync.integrations.vllm.worker import reference
        from vllm_nccl_sync.wire.protocol import TensorSpec

        ref = reference(self.vllm_config)
        specs = [TensorSpec(name=n, dtype=d, shape=list(s)) for n, d, s in specs]
        return [p.text for p in ref.problems(specs)]
