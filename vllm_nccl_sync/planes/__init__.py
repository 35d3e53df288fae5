"""Data planes behind one interface (`base.Transport`), opened by name (`registry.open_transport`).

- `gloo`: CPU tensors, point-to-point sends to each receiver; per-bucket digests and a canary.
- `nccl`: CUDA tensors, one broadcast collective per bucket; a deadman aborts a stuck group.
- `shm`, `ipc` (`shared`): the sender's buffers mapped by every receiver on one host.

Every group meets through `rendezvous`; `deadman` holds an update's deadline.
"""
