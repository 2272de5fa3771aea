"""GPU check step: the mp executor with one rank (a worker process, LOCAL_RANK 0) gives the greedy tokens
of the in-process (uni) worker on the same device. Run by scripts/gpu_check.sh. The model is
SmolLM2-135M's shape with random weights (benchmarks/platform_throughput.py): the GPU machine has no
embedded model and no network."""
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from platform_throughput import save_model  # noqa: E402

from vllite_core import LLM, SamplingParams  # noqa: E402

params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
prompts = [{"prompt_token_ids": list(range(100, 100 + n))} for n in (5, 60)]
got = {}
with tempfile.TemporaryDirectory() as path:
    save_model(path)
    for backend in ("uni", "mp"):
        llm = LLM(model=path, device="cuda", dtype="float32", max_model_len=256,
                  distributed_executor_backend=backend, gpu_memory_utilization=0.3)
        got[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        print(backend, llm.llm_engine.core.engine_core.executor.layout, got[backend], flush=True)
        llm.llm_engine.core.shutdown()
assert got["uni"] == got["mp"], got
print("PASS: mp (one worker process) == uni")
