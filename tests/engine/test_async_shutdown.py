"""`tests.helpers.stop_async_llm`: an `AsyncLLM` served from a loop thread (as `vllm serve` and
`benchmarks/bench_pause.py` run it) shuts down without vLLM logging a traceback.

`AsyncLLM.shutdown` stops the engine core before it cancels the output handler; the handler then
reads the `EngineDeadError` the closing output socket queues and logs "AsyncLLM output_handler
failed" with its traceback (a race: `tests/engine/test_benchmarks_smoke.py` hit it on every bench_pause
run before). `stop_async_llm` cancels the handler on the loop first.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.vllm
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent("""
    import asyncio, gc, sys, threading

    from tests.helpers import stop_async_llm
    from vllm_nccl_sync.tiny import engine_kwargs, make_model


    def main(path):
        from vllm import SamplingParams
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.async_llm import AsyncLLM

        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()
        args = AsyncEngineArgs(model=make_model(path, "qwen2", 1), **engine_kwargs())

        async def start():
            return AsyncLLM.from_engine_args(args)

        async def generate(engine):
            params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            async for out in engine.generate(TokensPrompt(prompt_token_ids=[5, 6, 7]), params,
                                             "r0"):
                pass
            return list(out.outputs[0].token_ids)

        engine = asyncio.run_coroutine_threadsafe(start(), loop).result(300)
        print("generated", asyncio.run_coroutine_threadsafe(generate(engine), loop).result(120))
        stop_async_llm(engine, loop)
        loop.call_soon_threadsafe(loop.stop)
        del engine
        gc.collect()  # AsyncLLM.__del__ runs while vLLM's modules are still there
        print("stopped", flush=True)


    if __name__ == "__main__":
        main(sys.argv[1])
""")


def test_async_llm_stops_without_a_traceback(tmp_path):
    pytest.importorskip("vllm")
    script = tmp_path / "serve_and_stop.py"
    script.write_text(SCRIPT)
    path = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, VLLM_LOGGING_LEVEL="INFO", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "model")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=400, check=False)
    out = proc.stdout + proc.stderr  # vLLM logs to stdout, Python's tracebacks go to stderr
    assert proc.returncode == 0, out[-4000:]
    assert "generated [" in proc.stdout and "stopped" in proc.stdout, out[-4000:]
    assert "[shutdown] MPClient: complete" in out, out[-4000:]  # vLLM's log of a full shutdown
    for word in ("Traceback", "EngineDeadError", "output_handler failed"):
        assert word not in out, out[-4000:]
