"""`vllite serve --tensor-parallel-size 2`: the server prints the layout it started (two worker processes)
and answers the real openai client with Hugging Face's greedy completion of the same weights."""
from __future__ import annotations

import pytest
import torch
from hf_reference import hf_greedy
from server_harness import ServerProcess
from test_tensor_parallel import QWEN2
from tiny_models import save_tiny

pytestmark = pytest.mark.slow


def test_served_tp2_completion_matches_hf(tmp_path):
    from openai import OpenAI
    from transformers import AutoTokenizer, Qwen2Config

    hf = save_tiny(tmp_path, Qwen2Config(**QWEN2, architectures=["Qwen2ForCausalLM"]))
    prompt = torch.randint(0, 509, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    expected = AutoTokenizer.from_pretrained(tmp_path).decode(hf_greedy(hf, prompt, 8))
    server = ServerProcess(["--model", str(tmp_path), "--served-model-name", "tiny", "--dtype", "float32",
                            "--tensor-parallel-size", "2", "--num-kv-blocks", "64"])
    try:
        url = server.wait_ready()
        out = server.output
        assert "parallel:      2 rank(s), mp executor, 1 node(s), collectives gloo" in out
        assert "rank 0: pid" in out and "rank 1: pid" in out
        client = OpenAI(base_url=url + "/v1", api_key="none")
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert got.choices[0].text == expected
    finally:
        assert server.stop() is not None
