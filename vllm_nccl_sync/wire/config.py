"""Configuration shared by the two ends; validated on construction, msgpack-friendly on the wire.

`SyncConfig` is a msgspec `Struct`: each field's bounds are declared once, in its annotation
(`msgspec.Meta`), and checked on every construction (keywords, `from_dict`, `build`, unpickling,
`msgspec.structs.replace`); the rules that tie fields together are `__post_init__`'s.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import typing
from collections.abc import Iterator, Mapping
from typing import Annotated, Any, Literal

import msgspec

from vllm_nccl_sync.wire.packing import ALIGN

Backend = Literal["gloo", "nccl", "shm", "ipc"]
"""Data planes both ends may name (`planes/registry.py` maps each to its class): `gloo` (CPU, any
host), `nccl` (GPUs, any host), `shm` (CPU, one host), `ipc` (one GPU shared, CUDA IPC)."""
BACKENDS: tuple[str, ...] = typing.get_args(Backend)
SAME_HOST = ("shm", "ipc")
"""Planes whose buffers are the sender's memory mapped by every receiver: one sender only."""

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024
"""512 MiB: on 2x H200 (NVLink) end-to-end updates of 8-16 GB models then run at 0.88-0.91 of a raw
broadcast, limited by the GPU rather than by per-bucket host work (benchmarks/results/)."""

Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
"""A TCP port to bind or reach (`build` turns 0 or None into a free one before construction)."""
Positive = Annotated[float, msgspec.Meta(gt=0)]
BucketBytes = Annotated[int, msgspec.Meta(ge=ALIGN, multiple_of=ALIGN)]
Hex = Annotated[str, msgspec.Meta(pattern="^(?:[0-9a-fA-F]{2})*$")]
Host = Annotated[str, msgspec.Meta(min_length=1)]


class FieldRefused(ValueError):
    """A `SyncConfig` field's value out of its bounds; `field` names it."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@contextlib.contextmanager
def spelled(door: str, spelling: Mapping[str, str] | None = None) -> Iterator[None]:
    """Inside: a `ValueError` about a config is raised again prefixed with the front door that
    took it (`door`) and, for one field, that field as the door's users spell it (`spelling`,
    {SyncConfig's name: the door's}), e.g. `Door.packed_buffer_size_bytes: SyncConfig.
    bucket_bytes=100: ...`. Without a `door`, unchanged."""
    try:
        yield
    except ValueError as e:
        if not door:
            raise
        field = getattr(e, "field", None)
        where = f"{door}.{(spelling or {}).get(field, field)}" if field else door
        raise type(e)(f"{where}: {e}", *([field] if field else [])) from None


class SyncConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Everything both ends must agree on. The trainer makes it; each engine gets it by RPC.

    Raises `ValueError` naming the field and its bound for a value out of bounds, or the rule
    broken for fields that do not fit together."""

    host: Host = "127.0.0.1"
    """Address the trainer binds (control socket and the group's TCPStore); loopback by default."""
    control_port: Port
    """ZeroMQ ROUTER port of the trainer."""
    group_port: Port
    """TCPStore port of the data-plane group."""
    world_size: Annotated[int, msgspec.Meta(ge=2)]
    """The senders (1, or M with `senders`) + every receiving worker of every engine."""
    backend: Backend = "gloo"
    """Data plane: `gloo` (CPU), `nccl` (GPU), `shm` (CPU, trainer and engines on one host) or
    `ipc` (trainer and engine sharing one GPU)."""
    bucket_bytes: BucketBytes = DEFAULT_BUCKET_BYTES
    """Capacity of one bucket; each side holds two buffers of it."""
    timeout_s: Positive = 120.0
    """Bound on every wait: rendezvous, control messages and collectives."""
    bucket_checksums: bool | None = None
    """Sender: checksum every bucket (None: on). Receivers decide for themselves whether they
    require checksums (engine-side `VLLM_NCCL_SYNC_REQUIRE_CHECKSUMS`, on unless set to 0); a
    sender with checksums off cannot push to a receiver that requires them."""
    secret: Hex = ""
    """Shared secret (hex) authenticating control frames with HMAC-SHA256; empty disables."""
    senders: tuple[tuple[Host, Port], ...] = ()
    """Several senders: `(host, group_port)` of the data-plane group of senders 1..M-1, each
    hosted by that sender (sender 0, the coordinator, is `host`/`group_port`). Receivers then
    start at rank M. Empty: one sender."""
    shard: bool = False
    """Shard to shard: each worker publishes its read set when it joins (what its loaders read
    of every checkpoint tensor), and each push of a state dict sends every worker only that,
    point to point (gloo, nccl; one sender)."""
    receive_process: bool = False
    """Receivers: each worker's gloo group lives in a process of its own, which receives the
    buckets into memory it shares with the worker (`planes/receive_process.py`): a sender that
    overruns a buffer ends that process, not the engine, and the engine's threads never share
    Python's lock with a receive (gloo, one sender)."""

    def __post_init__(self) -> None:
        for name, hint in _HINTS.items():
            value = getattr(self, name)
            try:
                checked = msgspec.convert(value, hint)
            except msgspec.ValidationError as e:
                choices = f" (one of {list(BACKENDS)})" if name == "backend" else ""
                raise FieldRefused(f"SyncConfig.{name}={value!r}: {e}{choices}", name) from None
            msgspec.structs.force_setattr(self, name, checked)  # [[h, p]] -> ((h, p),), 1 -> 1.0
        self._check_together()

    def _check_together(self) -> None:
        """The rules between fields (each field's own bounds are its annotation's)."""
        if self.backend in SAME_HOST and self.senders:
            raise ValueError(f"the {self.backend} plane takes one sender (its buffers are the "
                             "sender's memory); several senders need gloo or nccl")
        if self.receive_process and (self.backend != "gloo" or self.senders):
            raise ValueError("receive_process takes the gloo plane and one sender (got "
                             f"backend {self.backend!r}, {self.num_senders} sender(s))")
        if self.world_size < self.num_senders + 1:
            raise ValueError(f"world_size {self.world_size} must be >= {self.num_senders + 1} "
                             f"({self.num_senders} sender(s) and a receiver)")
        if self.control_port == self.group_port:
            raise ValueError(f"control_port and group_port must differ (both {self.group_port})")
        addrs = [(self.host, self.group_port), *self.senders]
        if len(set(addrs)) != len(addrs):
            raise ValueError(f"senders' data-plane addresses must differ: {addrs}")

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Every field that has a default, with it (`timeout_s` 120 s, `bucket_bytes` 512 MiB,
        ...): the one place front doors take their defaults from."""
        return {f.name: f.default for f in msgspec.structs.fields(cls) if not f.required}

    @classmethod
    def build(cls, *, door: str = "", spelling: Mapping[str, str] | None = None,
              **kwargs: Any) -> SyncConfig:
        """A config from a front door's own keyword arguments, without restating any default.

        A value of None takes the field's default; a `control_port` or `group_port` that is
        missing, None or 0 becomes a port free on `host` right now (the two distinct, and
        distinct from a given one). `world_size` is required. Raises `ValueError` for an unknown
        field or an invalid value (as the constructor does), naming `door` and the field as it
        spells it (`spelled`) where a door is given.
        """
        with spelled(door, spelling):
            given, pick, taken = cls._given(kwargs)
            host = given.get("host", cls.defaults()["host"])
            given.update(zip(pick, free_ports(host, len(pick), taken), strict=True))
            return cls(**given)

    @classmethod
    def check(cls, *, door: str = "", spelling: Mapping[str, str] | None = None,
              **kwargs: Any) -> None:
        """Raise what `build` would raise for these arguments, without picking any port (a
        front door checks its values where the user wrote them, and builds at each join)."""
        with spelled(door, spelling):
            given, pick, taken = cls._given(kwargs)
            avoid = taken | {a[1] for a in given.get("senders", ())
                             if isinstance(a, (list, tuple)) and len(a) == 2}
            spare = (p for p in itertools.count(1) if p not in avoid)  # as distinct as free ones
            given.update(zip(pick, spare))
            cls(**given)

    @classmethod
    def _given(cls, kwargs: dict[str, Any]) -> tuple[dict[str, Any], list[str], set[int]]:
        """`build`'s arguments that are given (not None), the ports it must pick, the ports
        given; `ValueError` for an unknown field or a missing `world_size`."""
        given = {k: v for k, v in kwargs.items() if v is not None}
        unknown = set(given) - set(cls.__struct_fields__)
        if unknown:
            raise ValueError(f"unknown SyncConfig fields: {sorted(unknown)}")
        if "world_size" not in given:
            raise ValueError("SyncConfig.build needs world_size")
        pick = [name for name in ("control_port", "group_port") if not given.get(name)]
        taken = {given[name] for name in ("control_port", "group_port") if given.get(name)}
        return given, pick, taken

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
        return msgspec.structs.replace(self, host=host, group_port=port, senders=(),
                                       world_size=self.world_size - self.num_senders + 1)

    @property
    def secret_bytes(self) -> bytes | None:
        """The shared secret as bytes (None: none)."""
        return bytes.fromhex(self.secret) if self.secret else None

    def to_dict(self) -> dict[str, Any]:
        """A msgpack/JSON-friendly dict (`from_dict` takes it back)."""
        d = msgspec.structs.asdict(self)
        d["senders"] = [list(a) for a in self.senders]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SyncConfig:
        """The config of `to_dict`; `ValueError` for unknown fields or invalid values."""
        unknown = set(d) - set(cls.__struct_fields__)
        if unknown:
            raise ValueError(f"unknown SyncConfig fields: {sorted(unknown)}")
        return cls(**d)


_HINTS: dict[str, Any] = typing.get_type_hints(SyncConfig, include_extras=True)
"""Each field's annotation, bounds included: what `__post_init__` checks a value against."""


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
