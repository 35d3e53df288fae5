"""Data planes behind one interface (`base.Transport`, `base.open_transport`), chosen by name.

- `gloo`: CPU tensors, point-to-point sends to each receiver; per-bucket digests and a canary.
- `nccl`: CUDA tensors, one broadcast collective per bucket; a deadman aborts a stuck group.
"""
