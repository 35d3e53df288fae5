"""Small, version-guarded adaptations to vLLM internals; each module names the upstream code it
relates to.

See the top-level `patches/README.md` for the list."""


def require_vllm(patch: str, supported: tuple[str, ...], check: str) -> str:
    """The installed vLLM version; RuntimeError naming `patch`, the versions it was written
    against and the upstream code to `check` unless the version starts with one of `supported`."""
    import vllm

    version = vllm.__version__
    if not version.startswith(supported):
        raise RuntimeError(f"vllm_nccl_sync.patches.{patch} supports vLLM {supported}, found "
                           f"{version}; check {check}")
    return version
