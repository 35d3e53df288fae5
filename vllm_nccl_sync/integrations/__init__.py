"""One home per framework: what vLLM (`vllm`), SGLang (`sglang`) and verl (`verl`) need to take
part in a transfer. `engine/` and `trainer/` import none of them; each is a thin adapter over
them (and only `integrations.vllm` imports its version-guarded vLLM patches)."""
