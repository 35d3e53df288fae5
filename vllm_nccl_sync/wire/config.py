"""Configuration shared by the two ends; validated on construction, msgpack-friendly on the wire."""

from __future__ import annotations

import contextlib
import socket
from dataclasses import MISSING, asdict, dataclass, fields, replace
from typing import Any

from vllm_nccl_sync.wire.packing import ALIGN

BACKENDS = ("gloo", "nccl", "shm", "ipc")
"""Data planes both ends may name (`vllm_nccl_sync/planes/<name>.py` each): `gloo` (CPU, any
host), `nccl` (GPUs, any host), `shm` (CPU, one host), `ipc` (one GPU shared, CUDA IPC)."""
SAME_HOST = ("shm", "ipc")
"""Planes whose buffers are the sender's memory mapped by every receiver: one sender only."""

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024
"""512 MiB: on 2x H200 (NVLink) end-to-end updates of 8-16 GB models then run at 0.88-0.91 of a raw
broadcast, limited by the GPU rather than by per-bucket host work (benchmarks/results/)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class SyncConfig:
    """Everything both ends must agree on. The trainer makes it; each engine gets it by RPC."""

    host: str = "127.0.0.1"
    """Address the trainer binds (control socket and the group's TCPStore); loopback by default."""
    control_port: int
    """ZeroMQ ROUTER port of the trainer."""
    group_port: int
    """TCPStore port of the data-plane group."""
    world_size: int
    """The senders (1, or M with `senders`) + every receiving worker of every engine."""
    backend: str = "gloo"
    """Data plane: `gloo` (CPU), `nccl` (GPU), `shm` (CPU, trainer and engines on one host) or
    `ipc` (trainer and engine sharing one GPU)."""
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Capacity of one bucket; each side holds two buffers of it."""
    timeout_s: float = 120.0
    """Bound on every wait: rendezvous, control messages and collectives."""
    bucket_checksums: bool | None = None
    """Sender: checksum every bucket (None: on). Receivers decide for themselves whether they
    require checksums (engine-side `VLLM_NCCL_SYNC_REQUIRE_CHECKSUMS`, on unless set to 0); a
    sender with checksums off cannot push to a receiver that requires them."""
    secret: str = ""
    """Shared secret (hex) authenticating control frames with HMAC-SHA256; empty disables."""
    senders: tuple[tuple[str, int], ...] = ()
    """Several senders: `(host, group_port)` of the data-plane group of senders 1..M-1, each
    hosted by that sender (sender 0, the coordinator, is `host`/`group_port`). Receivers then
    start at rank M. Empty: one sender."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "senders", tuple((str(h), int(p)) for h, p in self.senders))
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; choose one of {list(BACKENDS)}")
        if self.backend in SAME_HOST and self.senders:
            raise ValueError(f"the {self.backend} plane takes one sender (its buffers are the "
                             "sender's memory); several senders need gloo or nccl")
        if self.world_size < self.num_senders + 1:
            raise ValueError(f"world_size {self.world_size} must be >= {self.num_senders + 1} "
                             f"({self.num_senders} sender(s) and a receiver)")
        if self.bucket_bytes < ALIGN or self.bucket_bytes % ALIGN:
            raise ValueError(f"bucket_bytes {self.bucket_bytes} must be a positive multiple of {ALIGN}")
        for name in ("control_port", "group_port"):
            if not 0 < getattr(self, name) < 65536:
                raise ValueError(f"{name} {getattr(self, name)} out of range")
        if self.control_port == self.group_port:
            raise ValueError("control_port and group_port must differ")
        for host, port in self.senders:
            if not 0 < port < 65536:
                raise ValueError(f"group_port {port} of sender {host} out of range")
        addrs = [(self.host, self.group_port), *self.senders]
        if len(set(addrs)) != len(addrs):
            raise ValueError(f"senders' data-plane addresses must differ: {addrs}")
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        bytes.fromhex(self.secret)  # raises ValueError if not hex

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Every field that has a default, with it (`timeout_s` 120 s, `bucket_bytes` 512 MiB,
        ...): the one place front doors take their defaults from."""
        return {f.name: f.default for f in fields(cls) if f.default is not MISSING}

    @classmethod
    def build(cls, **kwargs: Any) -> SyncConfig:
        """A config from a front door's own keyword arguments, without restating any default.

        A value of None takes the field's default; a `control_port` or `group_port` that is
        missing, None or 0 becomes a port free on `host` right now (the two distinct, and
        distinct from a given one). `world_size` is required. Raises `ValueError` for an unknown
        field or an invalid value (as the constructor does).
        """
        given = {k: v for k, v in kwargs.items() if v is not None}
        unknown = set(given) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown SyncConfig fields: {sorted(unknown)}")
        if "world_size" not in given:
            raise ValueError("SyncConfig.build needs world_size")
        host = given.get("host", cls.defaults()["host"])
        pick = [name for name in ("control_port", "group_port") if not given.get(name)]
        taken = {given[name] for name in ("control_port", "group_port") if given.get(name)}
        given.update(zip(pick, free_ports(host, len(pick), taken), strict=True))
        return cls(**given)

    @property
    def num_senders(self) -> int:
        """M: the senders of every update (ranks 0..M-1)."""
        return 1 + len(self.senders)

    def group(self, src: int) -> SyncConfig:
        """The config of sender `src`'s data-plane group ({src} + every receiver; src is its
        rank 0 and hosts its rendezvous). With one sender: this config itself."""
        if not self.senders:
            return self
        host, port = (self.host, self.group_port) if src == 0 else self.senders[src - 1]
        return replace(self, host=host, group_port=port, senders=(),
                       world_size=self.world_size - self.num_senders + 1)

    @property
    def secret_bytes(self) -> bytes | None:
        """The shared secret as bytes (None: none)."""
        return bytes.fromhex(self.secret) if self.secret else None

    def to_dict(self) -> dict[str, Any]:
        """A msgpack/JSON-friendly dict (`from_dict` takes it back)."""
        d = asdict(self)
        d["senders"] = [list(a) for a in self.senders]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SyncConfig:
        """The config of `to_dict`; `ValueError` for unknown fields or invalid values."""
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown SyncConfig fields: {sorted(unknown)}")
        return cls(**d)


def free_ports(host: str, n: int, taken: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """`n` distinct TCP ports free on `host` right now, none of them in `taken` (all bound at
    once while they are picked, so they differ)."""
    ports: list[int] = []
    with contextlib.ExitStack() as held:
        while len(ports) < n:
            s = held.enter_context(socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET))
            s.bind((host, 0))
            if s.getsockname()[1] not in taken:
                ports.append(s.getsockname()[1])
    return ports
