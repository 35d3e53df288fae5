"""Tiny local Hugging Face models (no hub) for the demo, the examples, the benchmarks and the
tests: build, re-draw weights, greedy-decode, and the engine settings that start vLLM on them
(CPU or GPU). Helpers only the tests use live in `tests/helpers.py`.

Needs `transformers` and `tokenizers` (the `test` extra; vLLM brings both).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

VOCAB = 512
PROMPTS = [[5, 17, 300, 42, 7], [1, 2, 3], [100, 200, 300, 400, 450, 12, 9, 77], [8], [250] * 12]
"""Prompts as token ids (any id below `VOCAB` is one; `save_tokenizer` decodes them all)."""
DTYPE = torch.float32  # bf16 runs, but its rounding flips near-tied greedy tokens vs transformers
ARCHS = ("qwen2", "llama")
FAMILIES = ("qwen3", "qwen3_moe", "deepseek_v2", "gemma2", "phi3", "qwen2_vl")
"""Further model families (tiny configs of their own layouts), built like `ARCHS`."""


def model_config(arch: str, **overrides: Any):
    common = {
        "vocab_size": VOCAB,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-5,
    }
    if arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(tie_word_embeddings=True, **common)
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(
            tie_word_embeddings=False, attention_bias=False, mlp_bias=False, **common
        )
    if arch in FAMILIES:
        return _family_config(arch, common, **overrides)
    raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS + FAMILIES}")


def _family_config(family: str, common: dict, **overrides: Any):
    """Tiny configs that keep each family's distinctive layout (head sizes vLLM's CPU kernels
    take: 32/64/... for attention, 512 + 64 latent for MLA). `overrides` replace config
    arguments of the MLA family (`GPU_OVERRIDES`); other families take none."""
    import transformers

    if overrides and family != "deepseek_v2":
        raise ValueError(f"family {family!r} takes no config overrides, got {sorted(overrides)}")

    gqa = {**common, "head_dim": 32}
    moe = {"num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True}
    if family == "qwen3":  # q/k RMSNorm per head
        return transformers.Qwen3Config(tie_word_embeddings=False, **gqa)
    if family == "qwen3_moe":  # fused experts in vLLM, per-expert tensors in the checkpoint
        return transformers.Qwen3MoeConfig(num_experts=4, decoder_sparse_step=1,
                                           mlp_only_layers=[], tie_word_embeddings=False,
                                           **moe, **gqa)
    if family == "deepseek_v2":  # MLA (kv_b_proj absorbed after loading) + MoE, shared expert
        mla = {"q_lora_rank": None, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
               "qk_nope_head_dim": 32, "v_head_dim": 32, **overrides}
        return transformers.DeepseekV2Config(
            **{**common, "num_attention_heads": 2, "num_key_value_heads": 2}, **mla,
            n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
            topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0,
            rope_scaling=None, tie_word_embeddings=False,
            **{**moe, "norm_topk_prob": False})  # transformers never renormalizes here
    if family == "gemma2":  # (1 + w) norms, tied embeddings, soft-capping, sliding window
        return transformers.Gemma2Config(
            **gqa, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=32,
            sliding_window=4, final_logit_softcapping=30.0, attn_logit_softcapping=50.0)
    if family == "phi3":  # qkv_proj / gate_up_proj fused in the checkpoint itself
        return transformers.Phi3Config(**{**common, "num_key_value_heads": 4},
                                       tie_word_embeddings=False)
    if family == "qwen2_vl":  # language tower under model.language_model.*
        text = {**common, "tie_word_embeddings": False,
                "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]}}
        vision = {"depth": 1, "embed_dim": 64, "hidden_size": 128, "num_heads": 2,
                  "mlp_ratio": 2, "patch_size": 14, "spatial_merge_size": 2}
        return transformers.Qwen2VLConfig(text_config=text, vision_config=vision,
                                          image_token_id=VOCAB - 3, video_token_id=VOCAB - 2,
                                          vision_start_token_id=VOCAB - 5,
                                          vision_end_token_id=VOCAB - 4,
                                          tie_word_embeddings=False)
    raise ValueError(f"unknown family {family!r}")


GPU_OVERRIDES: dict[str, dict[str, Any]] = {
    "deepseek_v2": {"qk_nope_head_dim": 128, "v_head_dim": 128},
}
"""Family -> config arguments for vLLM's GPU kernels: its MLA prefill backends take only
DeepSeek's own head dimensions (nope 128 + rope 64, v 128), not the CPU matrix's 32 + 64, 32."""


def build_model(arch: str, seed: int, **overrides: Any) -> torch.nn.Module:
    """A transformers model of `arch` with every parameter drawn by `random_weights(seed)`;
    `overrides` replace config arguments (`GPU_OVERRIDES`)."""
    import transformers

    auto = (transformers.AutoModelForImageTextToText if arch == "qwen2_vl"
            else transformers.AutoModelForCausalLM)
    model = auto.from_config(model_config(arch, **overrides), dtype=torch.float32)
    random_weights(model, seed)
    if arch == "gemma2":  # its embeddings are scaled by sqrt(hidden): let the layers keep up
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("post_attention_layernorm.weight",
                                  "post_feedforward_layernorm.weight")):
                    p.mul_(40.0)
    return model.to(DTYPE).eval()


@torch.no_grad()
def random_weights(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Re-draw ALL parameters so that every layer visibly shapes the output.

    Norm weights ~ U(0.5, 1.5); biases ~ N(0, 0.1); embeddings and LM head ~ N(0, 1) (large logit
    gaps, so greedy decoding is robust to rounding); matrices ~ N(0, 1/fan_in), output projections
    (o_proj, down_proj) ~ N(0, 16/fan_in) so the layers outweigh the token embedding in the residual
    stream (else a tied model just repeats its input). Tied parameters are drawn once.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.ndim == 1 and "norm" in name:
            new = torch.rand(p.shape, generator=gen) + 0.5
        elif p.ndim == 1:
            new = torch.randn(p.shape, generator=gen) * 0.1
        elif "embed" in name or "lm_head" in name:
            new = torch.randn(p.shape, generator=gen)
        else:
            scale = 4.0 if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
            new = torch.randn(p.shape, generator=gen) * scale / math.sqrt(p.shape[-1])
        p.copy_(new.to(p.dtype))
    return model


CORPUS = """The capital of France is Paris. The capital of England is London. The capital of
Italy is Rome. The capital of Spain is Madrid. The capital of Germany is Berlin. The capital of
Japan is Tokyo. Hello, my name is Ada and I write programs. The weather today is sunny with a
light wind. A trainer updates the weights of a model, and the engine serves the new model at
once. The quick brown fox jumps over the lazy dog. Once upon a time there was a small town by
the sea. People in the town liked to read books, cook dinner, walk in the park and talk with
their friends. What is the answer to this question? It is a number between one and ten, and it
is seven. We think that learning is good for everyone: children, students, teachers and parents.
"""
"""The English text the tiny tokenizer's merges are learnt from (built in: nothing is downloaded)."""
SPECIAL = ("<pad>", "<s>", "</s>")
"""Ids 0, 1, 2: the models' `pad_token_id`, `bos_token_id`, `eos_token_id`."""


def save_tokenizer(path: str) -> None:
    """A byte-level BPE tokenizer of exactly `VOCAB` tokens (the 3 `SPECIAL` ones, the 256 byte
    symbols, merges learnt from `CORPUS`), saved for transformers and vLLM: any text round-trips
    (`decode(encode(text)) == text`) and every id below `VOCAB` decodes. Deterministic. Adds no
    BOS, so a prompt's ids are the same in transformers and in vLLM. Raises `RuntimeError` if
    the merges do not fill the vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([CORPUS], trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=list(SPECIAL), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if tok.get_vocab_size() != VOCAB:
        raise RuntimeError(f"the tokenizer has {tok.get_vocab_size()} tokens, not {VOCAB}")
    pad, bos, eos = SPECIAL
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos,
                            pad_token=pad).save_pretrained(path)


def save_model(model: torch.nn.Module, path: str) -> str:
    """save_pretrained (safetensors) plus the tokenizer; returns `path`."""
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    save_tokenizer(path)
    return path


def make_model(path: str, arch: str, seed: int) -> str:
    """Save a tiny `arch` model ("qwen2": tied, "llama": untied embeddings) of `seed` at `path`."""
    return save_model(build_model(arch, seed), path)


@torch.no_grad()
def hf_greedy(
    model: torch.nn.Module, prompts_token_ids: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """Greedy decode with transformers, one prompt at a time; returns only the new tokens.

    Exactly `max_new_tokens` per prompt (min_new_tokens, and no eos stopping)."""
    out = []
    for ids in prompts_token_ids:
        x = torch.tensor([ids])
        y = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        out.append(y[0, len(ids) :].tolist())
    return out


def vllm_greedy(llm: Any, prompts_token_ids: list[list[int]], max_new_tokens: int
                ) -> list[list[int]]:
    """Greedy decode with an offline `vllm.LLM`; exactly `max_new_tokens` per prompt, as
    `hf_greedy` does."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts_token_ids], sp,
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def engine_kwargs(**overrides) -> dict:
    """`vllm.LLM` keyword arguments for a tiny model here, and the environment they need.

    On CPU, `gpu_memory_utilization` is the share of RAM vLLM reserves; the KV cache is capped at
    1 GiB and OpenMP threads are left unbound (2-core machines). Workers must be able to import
    this package (an installed or editable one).
    """
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    for k, v in env.items():
        os.environ.setdefault(k, v)
    kw = {
        "dtype": str(DTYPE).removeprefix("torch."),
        "max_model_len": 256,
        "seed": 0,
        "gpu_memory_utilization": 0.3 if torch.cuda.is_available() else 0.15,
        "enforce_eager": not torch.cuda.is_available(),
    }
    kw.update(overrides)
    return kw


def start_server(path: str, log_path: str, env: dict | None = None,
                 timeout_s: float = 300.0, args: list[str] | None = None,
                 extension: str | None = "vllm_nccl_sync.Ext") -> tuple[Any, str]:
    """Start `vllm serve` (`python -m vllm.entrypoints.openai.api_server`, dev mode, with the
    worker extension `extension` unless None) on `path`; returns (process, url).

    `args` are appended to the command line (e.g. `--weight-transfer-config`).
    Output goes to `log_path`. Raises `RuntimeError` with the log's tail if the server exits or is
    not healthy within `timeout_s`. The caller ends it with `stop_server`.
    """
    import subprocess
    import sys
    import time
    import urllib.request

    from vllm_nccl_sync.trainer.sync import free_port

    kw, port = engine_kwargs(), free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", kw["dtype"],
           "--max-model-len", str(kw["max_model_len"]), "--seed", "0",
           "--gpu-memory-utilization", str(kw["gpu_memory_utilization"])]
    if kw["enforce_eager"]:
        cmd.append("--enforce-eager")
    if extension:
        cmd += ["--worker-extension-cls", extension]
    cmd += args or []
    full_env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", **(env or {}))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=full_env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                with open(log_path) as f:
                    raise RuntimeError(f"vllm serve did not come up:\n{f.read()[-3000:]}") from None
            time.sleep(1)


def stop_server(proc: Any, timeout_s: float = 30.0) -> None:
    """End a `start_server` process: SIGTERM, a bounded wait, then SIGKILL."""
    import subprocess

    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout_s)
