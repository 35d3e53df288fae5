"""Import paths that moved keep working for a while: the same objects, and a DeprecationWarning
naming the new path. Each is imported in a fresh process, as a user's script would."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vllm_nccl_sync.moved import MOVED

CHECK = """
import importlib, warnings, pickle
warnings.simplefilter("error", DeprecationWarning)
try:
    importlib.import_module({old!r})
except DeprecationWarning as w:
    assert {new!r} in str(w), w
else:
    raise SystemExit("no DeprecationWarning")
warnings.simplefilter("ignore", DeprecationWarning)
old, new = importlib.import_module({old!r}), importlib.import_module({new!r})
names = getattr(new, "__all__", None) or [n for n in vars(new) if not n.startswith("_")]
assert names and all(getattr(old, n) is getattr(new, n) for n in names), names
print(len(names))
"""


@pytest.mark.parametrize("old,new", sorted(MOVED.items()))
def test_an_old_path_warns_and_holds_the_new_objects(old, new):
    out = subprocess.run([sys.executable, "-c", CHECK.format(old=old, new=new)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:] + out.stdout
    assert int(out.stdout.split()[-1]) > 0


def test_a_class_from_an_old_path_pickles_under_its_new_one():
    import pickle
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from vllm_nccl_sync.glue.weight_transfer import NcclSyncTrainerInitInfo

    assert NcclSyncTrainerInitInfo.__module__.startswith("vllm_nccl_sync.integrations.vllm.")
    assert b"glue" not in pickle.dumps(NcclSyncTrainerInitInfo)


def test_a_path_that_never_existed_still_fails():
    with pytest.raises(ModuleNotFoundError):
        __import__("vllm_nccl_sync.glue.nothing_here")


FACE = {
    "PROTOCOL_VERSION", "AsyncLLMHandle", "EngineHandle", "Ext", "HTTPHandle", "LLMHandle",
    "PeerFailed", "ProtocolError", "PushClient", "PushError", "PushResult", "SyncConfig",
    "SyncError", "UpdateFailed", "UpdateRefused", "WeightSync", "WorkerSummary", "full_tensors",
    "verify",
}
"""The package face's names before the package was reorganised: each is still there."""


def test_the_package_face_keeps_every_name_it_had():
    import vllm_nccl_sync

    assert FACE <= set(vllm_nccl_sync.__all__), FACE - set(vllm_nccl_sync.__all__)
    assert all(getattr(vllm_nccl_sync, n, None) is not None for n in vllm_nccl_sync.__all__)
