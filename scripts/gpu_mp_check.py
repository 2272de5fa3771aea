"""GPU check step: the mp executor with one rank (a worker process, LOCAL_RANK 0) gives the greedy tokens
of the in-process (uni) worker on the same device. Run by scripts/gpu_check.sh."""
from vllite_core import LLM, SamplingParams

params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
prompts = [{"prompt_token_ids": list(range(100, 100 + n))} for n in (5, 60)]
got = {}
for backend in ("uni", "mp"):
    llm = LLM(device="cuda", dtype="float32", max_model_len=256, distributed_executor_backend=backend,
              gpu_memory_utilization=0.3)
    got[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    print(backend, llm.llm_engine.core.executor.layout, got[backend], flush=True)
    llm.llm_engine.core.shutdown()
assert got["uni"] == got["mp"], got
print("PASS: mp (one worker process) == uni")
