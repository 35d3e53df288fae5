"""Small, version-guarded adaptations to vLLM internals; each module names the upstream code it
relates to.

See the top-level `patches/README.md` for the list."""

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


def require_vllm(patch: str, supported: tuple[str, ...], check: str) -> str:
    """The installed vLLM version; RuntimeError naming `patch`, the versions it was written
    against and the upstream code to `check` unless the version starts with one of `supported`."""
    import vllm

    version = vllm.__version__
    if not version.startswith(supported):
        raise RuntimeError(f"{__name__}.{patch} supports vLLM {supported}, found {version}; "
                           f"check {check}")
    return version


def plugin(apply: Callable[[], None], supported: tuple[str, ...], without: str) -> None:
    """Run `apply()` (a `vllm.general_plugins` entry point's work) if the installed vLLM starts
    with one of `supported`; otherwise, or if it raises, log what is missing (`without`, e.g.
    "updates are not told about sleep mode"). Never raises: a plugin must not stop vLLM."""
    try:
        import vllm

        if not vllm.__version__.startswith(supported):
            log.warning("vllm_nccl_sync: vLLM %s is not one of %s: %s", vllm.__version__,
                        supported, without)
            return
        apply()
    except Exception:  # noqa: BLE001 - see above
        log.exception("vllm_nccl_sync: a patch could not be applied: %s", without)
