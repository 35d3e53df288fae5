"""The data planes by name: `cfg.backend` -> the module and class that implement it.

Both ends open their plane here (`open_transport`). A plane's module is imported the first time
its name is asked for, so a process that never names `ipc` never loads CUDA IPC code. A new plane
is a module beside `gloo.py` and one line in `PLANES`; its name is also one of the config's
(`wire.config.Backend`), which is what both ends agree on.
"""

from __future__ import annotations

import importlib

import torch

from vllm_nccl_sync.planes.base import Transport
from vllm_nccl_sync.wire.config import SyncConfig

PLANES: dict[str, tuple[str, str]] = {
    "gloo": ("vllm_nccl_sync.planes.gloo", "GlooTransport"),
    "nccl": ("vllm_nccl_sync.planes.nccl", "NcclTransport"),
    "shm": ("vllm_nccl_sync.planes.shm", "ShmTransport"),
    "ipc": ("vllm_nccl_sync.planes.ipc", "IpcTransport"),
}
"""Each plane's name -> (module, class)."""

POLICIES = ("backend", "digest_per_bucket", "canary_bytes", "peer_harm")
"""What every plane states of itself (see `Transport`)."""


def plane(name: str) -> type[Transport]:
    """The class of data plane `name`, its module imported on first use. `ValueError` for a name
    no plane has (the known ones listed); `TypeError` for a class that is not a plane of that
    name or does not state its policies (`POLICIES`)."""
    try:
        module, qualname = PLANES[name]
    except (KeyError, TypeError):
        raise ValueError(f"no data plane {name!r}; the known ones: {sorted(PLANES)}") from None
    cls = getattr(importlib.import_module(module), qualname)
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise TypeError(f"data plane {name!r}: {module}.{qualname} is not a Transport")
    missing = [a for a in POLICIES if not hasattr(cls, a)]
    if missing:
        raise TypeError(f"data plane {name!r} ({qualname}) does not state {missing}")
    if cls.backend != name:
        raise TypeError(f"data plane {name!r} ({qualname}) calls itself {cls.backend!r}")
    return cls


def open_transport(cfg: SyncConfig, rank: int, device: torch.device | None = None) -> Transport:
    """Join the data plane `cfg.backend` names as `rank` of its group (see `Transport`); a
    receiver of `cfg.receive_process` joins it through a process of its own."""
    if cfg.receive_process and rank != 0:
        from vllm_nccl_sync.planes.receive_process import ProcessTransport

        return ProcessTransport(cfg, rank, device)
    return plane(cfg.backend)(cfg, rank, device)
