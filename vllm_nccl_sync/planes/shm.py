"""The shared-memory data plane: a trainer and CPU engines on one host (see `shared`).

The sender's two bucket buffers are one POSIX shared-memory segment (mode 0600, a random name
that is unlinked once every receiver mapped it, so nothing else can open it and nothing is left
in /dev/shm if a process dies); receivers load straight from it. Checksums: as on gloo, each
bucket's on the host, checked against the sender's `Digest` before anything of it is loaded.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch

from vllm_nccl_sync.planes.base import register
from vllm_nccl_sync.planes.shared import Segment, SharedTransport, create_segment, open_segment


@register("shm")
class ShmTransport(SharedTransport):
    """CPU buckets in a shared-memory segment the receivers map once (see the module)."""

    digest_per_bucket = True
    peer_harm = (
        "a peer cannot crash this process: a sender publishing another length than the header's "
        "fails the receiver's wait (nothing loaded, group broken); bytes garbled in the segment "
        "fail the bucket's checksum; a receiver that never releases a buffer is lost at the "
        "timeout (at once if its process exited); a segment of another name or size is refused")

    def _device(self, device: torch.device | None) -> torch.device:
        return torch.device("cpu")

    def _export(self, nbytes: int, keep: list[Any]) -> tuple[bytes, list[torch.Tensor]]:
        seg, mem = create_segment(2 * nbytes)
        keep.append(mem)
        self._segments.append(seg)
        return msgspec.msgpack.encode(seg), self._views(mem, nbytes)

    def _open(self, handle: bytes, nbytes: int, keep: list[Any]) -> list[torch.Tensor]:
        seg = msgspec.msgpack.decode(handle, type=Segment)
        mem = open_segment(seg, 2 * nbytes)
        keep.append(mem)
        return self._views(mem, nbytes)

    @staticmethod
    def _views(mem: Any, nbytes: int) -> list[torch.Tensor]:
        flat = torch.frombuffer(mem, dtype=torch.uint8, count=2 * nbytes)
        return [flat[:nbytes], flat[nbytes:]]
