"""`SyncConfig`: each field's bounds (its annotation's), the rules between fields, its travels."""

from __future__ import annotations

import pickle

import msgspec
import pytest

from vllm_nccl_sync.wire.config import BACKENDS, SyncConfig

BASE = {"control_port": 5000, "group_port": 5001, "world_size": 2}


def _cfg(**kw) -> SyncConfig:
    return SyncConfig(**{**BASE, **kw})


@pytest.mark.parametrize(("field", "value", "bound"), [
    ("control_port", 0, ">= 1"),
    ("control_port", 65536, "<= 65535"),
    ("group_port", -1, ">= 1"),
    ("group_port", "5001", "Expected `int`, got `str`"),
    ("world_size", 1, ">= 2"),
    ("world_size", True, "Expected `int`, got `bool`"),
    ("bucket_bytes", 0, ">= 64"),
    ("bucket_bytes", -64, ">= 64"),
    ("bucket_bytes", 100, "multiple of 64"),
    ("timeout_s", 0, "> 0"),
    ("timeout_s", -1.5, "> 0"),
    ("backend", "rdma", "one of ['gloo', 'nccl', 'shm', 'ipc']"),
    ("secret", "xyz", "matching regex"),
    ("secret", "abc", "matching regex"),
    ("host", "", "length >= 1"),
    ("bucket_checksums", 1, "Expected `bool | null`"),
    ("senders", [("10.0.0.2", 70000)], "<= 65535 - at `$[0][1]`"),
    ("senders", [("10.0.0.2",)], "Expected `array` of length 2"),
])
def test_each_bound_is_refused_naming_the_field(field, value, bound):
    with pytest.raises(ValueError) as e:
        SyncConfig(**{**BASE, "world_size": 3, field: value})
    assert str(e.value).startswith(f"SyncConfig.{field}={value!r}: "), e.value
    assert bound in str(e.value), e.value


def test_values_at_the_bounds_are_taken_and_normalised():
    cfg = _cfg(control_port=1, group_port=65535, bucket_bytes=64, timeout_s=1, secret="aB09",
               senders=[["10.0.0.2", 6000]], world_size=3)
    assert cfg.timeout_s == 1.0 and type(cfg.timeout_s) is float
    assert cfg.senders == (("10.0.0.2", 6000),) and cfg.secret_bytes == b"\xab\x09"
    assert hash(cfg) == hash(_cfg(control_port=1, group_port=65535, bucket_bytes=64,
                                  timeout_s=1.0, secret="aB09", world_size=3,
                                  senders=(("10.0.0.2", 6000),)))
    for backend in BACKENDS:
        assert _cfg(backend=backend).backend == backend


def test_the_rules_between_fields():
    with pytest.raises(ValueError, match=r"control_port and group_port must differ \(both 5000\)"):
        _cfg(group_port=5000)
    with pytest.raises(ValueError, match="world_size 2 must be >= 3"):
        _cfg(senders=[("10.0.0.2", 6000)])
    with pytest.raises(ValueError, match="the ipc plane takes one sender"):
        _cfg(backend="ipc", senders=[("10.0.0.2", 6000)], world_size=3)
    with pytest.raises(ValueError, match="addresses must differ"):
        _cfg(senders=[("127.0.0.1", 5001)], world_size=3)
    with pytest.raises(ValueError, match="addresses must differ"):
        _cfg(senders=[("10.0.0.2", 6000), ("10.0.0.2", 6000)], world_size=4)


def test_keywords_only_and_every_required_field():
    with pytest.raises(TypeError):
        SyncConfig("127.0.0.1", 5000, 5001, 2)  # type: ignore[misc]
    with pytest.raises(TypeError, match="world_size"):
        SyncConfig(control_port=5000, group_port=5001)  # type: ignore[call-arg]


def test_frozen_and_replace_is_checked():
    cfg = _cfg()
    with pytest.raises(AttributeError):
        cfg.timeout_s = 5.0  # type: ignore[misc]
    with pytest.raises(ValueError, match="SyncConfig.timeout_s"):
        msgspec.structs.replace(cfg, timeout_s=-1.0)


def test_round_trips():
    cfg = _cfg(host="10.0.0.1", backend="nccl", bucket_bytes=1 << 20, timeout_s=7.5,
               bucket_checksums=False, secret="00ff", senders=[("10.0.0.2", 6000)], world_size=4)
    d = cfg.to_dict()
    assert d["senders"] == [["10.0.0.2", 6000]]
    assert SyncConfig.from_dict(d) == cfg
    assert SyncConfig.from_dict(msgspec.json.decode(msgspec.json.encode(d))) == cfg
    assert SyncConfig.from_dict(msgspec.msgpack.decode(msgspec.msgpack.encode(d))) == cfg
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    assert msgspec.convert(d, SyncConfig) == cfg
    with pytest.raises(ValueError, match=r"unknown SyncConfig fields: \['port'\]"):
        SyncConfig.from_dict({**d, "port": 1})
    with pytest.raises(ValueError, match="SyncConfig.bucket_bytes=3"):
        SyncConfig.from_dict({**d, "bucket_bytes": 3})


def test_groups_of_several_senders_are_valid_configs():
    cfg = _cfg(senders=[("10.0.0.2", 6000), ("10.0.0.3", 6001)], world_size=5)
    assert cfg.group(0) == _cfg(world_size=3)
    g2 = cfg.group(2)
    assert (g2.host, g2.group_port, g2.world_size, g2.senders) == ("10.0.0.3", 6001, 3, ())
    one = _cfg()
    assert one.group(0) is one  # one sender: its own group


def test_build_picks_ports_and_takes_defaults():
    cfg = SyncConfig.build(world_size=2, control_port=0, group_port=None, timeout_s=None)
    assert cfg.control_port != cfg.group_port and cfg.timeout_s == 120.0
    assert SyncConfig.defaults() == {
        "host": "127.0.0.1", "backend": "gloo", "bucket_bytes": 512 * 1024 * 1024,
        "timeout_s": 120.0, "bucket_checksums": None, "secret": "", "senders": (),
        "shard": False, "receive_process": False}
    with pytest.raises(ValueError, match=r"unknown SyncConfig fields: \['bucket'\]"):
        SyncConfig.build(world_size=2, bucket=1)
    with pytest.raises(ValueError, match="needs world_size"):
        SyncConfig.build()
    with pytest.raises(ValueError, match="SyncConfig.backend='tcp'"):
        SyncConfig.build(world_size=2, backend="tcp")


def test_a_door_names_itself_and_the_field_as_its_users_spell_it():
    spelling = {"bucket_bytes": "bucket_size"}
    with pytest.raises(ValueError, match=r"^Door\.bucket_size: SyncConfig\.bucket_bytes=100: "):
        SyncConfig.build(world_size=2, bucket_bytes=100, door="Door", spelling=spelling)
    with pytest.raises(ValueError, match=r"^Door\.timeout_s: SyncConfig\.timeout_s=0"):
        SyncConfig.check(world_size=2, timeout_s=0, door="Door", spelling=spelling)
    with pytest.raises(ValueError, match=r"^Door: control_port and group_port must differ"):
        SyncConfig.check(world_size=2, control_port=5, group_port=5, door="Door")
    with pytest.raises(ValueError, match=r"^SyncConfig\.bucket_bytes=100"):  # no door: as ever
        SyncConfig.check(world_size=2, bucket_bytes=100)


def test_check_takes_what_build_takes_without_picking_ports():
    SyncConfig.check(world_size=2, host="10.0.0.1")  # not this host's: no port is bound
    SyncConfig.check(world_size=3, control_port=1, senders=[["127.0.0.1", 2]])
    assert SyncConfig.check(world_size=2, group_port=1) is None


def test_free_port_never_gives_a_port_it_gave_lately():
    from vllm_nccl_sync.trainer.sync import free_port

    ports = [free_port() for _ in range(200)]  # the OS may hand a just-closed port out again
    assert len(set(ports)) == len(ports)
