"""The one native part: the host's summing copy (`vllm_nccl_sync/wire/_copysum.c`). Optional: where
it cannot be built, `integrity.copy_summed_host` copies and sums with torch instead (slower)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("vllm_nccl_sync.wire._copysum", ["vllm_nccl_sync/wire/_copysum.c"],
                             extra_compile_args=["-O3"], optional=True)])
