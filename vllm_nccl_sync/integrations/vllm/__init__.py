"""vLLM: the worker extension (`ext.Ext`) and its worker glue (`worker`), the loader into the live
model (`loader`, `model_slots`, recorded copies replayed in `copyplan` and `graphs`), LoRA
(`lora`), the engine handles `WeightSync` drives (`handles`), what `verify` reads back in
checkpoint terms (`checksums`), the weight-transfer backend `nccl_sync` (`transfer`, public as
`vllm_nccl_sync.weight_transfer`) and version-guarded patches of vLLM internals (`patches`)."""
