"""Default sampling parameters from the model's generation_config.json (``generation_config`` /
``--generation-config auto|vllite|FOLDER``), checked through processed logprobs against HF logits on the
same weights, offline and through the real ``openai`` client."""
from __future__ import annotations

import json
import logging
import math
import shutil

import pytest
import torch
from hf_reference import hf_greedy
from server_harness import ServerProcess

from vllite_core.entrypoints.llm import LLM
from vllite_core.errors import ConfigError
from vllite_core.sampling_params import SamplingParams

PROMPT = [1, 17, 42, 99, 7, 250]
TEMPERATURE, TOP_K, MAX_NEW = 0.5, 3, 6
FLOOR = -9999.0  # what the server writes for -inf


@pytest.fixture(scope="module")
def model(tmp_path_factory, tiny_path):
    """The tiny Llama with a generation_config.json setting temperature, top_k, max_new_tokens and a second
    EOS id: the token greedy decoding produces third. Returns (folder, HF model, that EOS id)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    greedy = hf_greedy(hf, PROMPT, 6)
    eos2 = greedy[2]
    assert eos2 not in greedy[:2] and eos2 != 2
    folder = tmp_path_factory.mktemp("gen-defaults")
    shutil.copytree(tiny_path, folder, dirs_exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": [2, eos2], "do_sample": True, "temperature": TEMPERATURE,
         "top_k": TOP_K, "max_new_tokens": MAX_NEW}))
    return str(folder), hf, eos2


def _processed_reference(hf, ids: list[int], temperature: float, top_k: int) -> torch.Tensor:
    """log-probs after temperature and top-k, from HF's logits at the last position of ``ids``."""
    with torch.inference_mode():
        logits = hf(input_ids=torch.tensor([ids])).logits[0, -1].float() / temperature
    if top_k:
        cut = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < cut, -math.inf)
    return torch.log_softmax(logits, -1)


def _check_positions(hf, comp, temperature: float, top_k: int, k: int) -> None:
    ids = list(PROMPT)
    for tok, entry in zip(comp.token_ids, comp.logprobs):
        ref = _processed_reference(hf, ids, temperature, top_k)
        top = torch.topk(ref, k)
        finite = [tid for tid, v in zip(top.indices.tolist(), top.values.tolist()) if math.isfinite(v)]
        assert len(finite) == (min(top_k, k) if top_k else k)
        for tid in finite:
            assert abs(entry[tid].logprob - float(ref[tid])) < 1e-3
        assert math.isfinite(entry[tok].logprob)
        ids.append(tok)


def test_model_defaults_apply_and_a_request_overrides_them(model, caplog):
    folder, hf, eos2 = model
    with caplog.at_level(logging.WARNING, logger="vllite.engine"):
        llm = LLM(folder, dtype="float32", num_kv_blocks=64, logprobs_mode="processed_logprobs")
    assert "Default sampling parameters have been overridden" in caplog.text
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (TEMPERATURE, TOP_K, MAX_NEW)
    assert defaults.top_p == 1.0 and defaults.repetition_penalty == 1.0  # not in the file: neutral
    # Unset (the defaults, asking for logprobs): temperature 0.5 and top-k 3 shape the processed logprobs.
    defaults.logprobs, defaults.seed, defaults.ignore_eos = 5, 7, True
    comp = llm.generate([{"prompt_token_ids": PROMPT}], defaults)[0].outputs[0]
    assert len(comp.token_ids) == MAX_NEW
    _check_positions(hf, comp, TEMPERATURE, TOP_K, 5)
    # Set: the request's own values win.
    own = SamplingParams(temperature=1.0, top_k=0, max_tokens=4, logprobs=5, seed=7, ignore_eos=True)
    comp = llm.generate([{"prompt_token_ids": PROMPT}], own)[0].outputs[0]
    assert len(comp.token_ids) == 4
    _check_positions(hf, comp, 1.0, 0, 5)
    # No params at all: the defaults (max_new_tokens caps the length).
    out = llm.generate([{"prompt_token_ids": PROMPT}])[0].outputs[0]
    assert 1 <= len(out.token_ids) <= MAX_NEW
    # The generation config's second EOS id stops generation, as in HF generate on the same folder.
    from transformers import AutoModelForCausalLM

    ref_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = ref_model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=MAX_NEW)[0, len(PROMPT):]
    greedy = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=MAX_NEW))
    assert greedy[0].outputs[0].token_ids == ref.tolist() and ref.tolist()[-1] == eos2
    assert greedy[0].outputs[0].finish_reason == "stop"


def test_generation_config_vllite_and_folder(model, tmp_path):
    folder, hf, eos2 = model
    for spelling in ("vllite", "vllm"):
        llm = LLM(folder, dtype="float32", num_kv_blocks=32, generation_config=spelling)
        d = llm.get_default_sampling_params()
        assert (d.temperature, d.top_k, d.max_tokens) == (1.0, 0, 16)
    # vLLM reads the EOS ids in every mode: greedy still stops at the second EOS id.
    greedy = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=MAX_NEW))
    assert greedy[0].outputs[0].token_ids[-1] == eos2
    other = tmp_path / "gen"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.25, "top_p": 0.9}))
    d = LLM(folder, dtype="float32", num_kv_blocks=32, generation_config=str(other)).get_default_sampling_params()
    assert (d.temperature, d.top_p, d.top_k, d.max_tokens) == (0.25, 0.9, 0, 16)
    with pytest.raises(ConfigError, match="generation_config"):
        LLM(folder, generation_config=str(tmp_path / "no-such-folder"))


def _complete(client, **kw):
    return client.completions.create(model="tiny", prompt=PROMPT, logprobs=5, seed=3, **kw)


def _cut_off(resp) -> list[bool]:
    """Per position: whether the top-5 holds an entry at the -inf floor (cut off by top-k). The legacy format
    keys entries by text, so two tokens with one text show as one entry: count nothing beyond presence."""
    return [any(v <= FLOOR for v in pos.values()) for pos in resp.choices[0].logprobs.top_logprobs]


def _most_finite(resp) -> int:
    return max(sum(1 for v in pos.values() if v > FLOOR) for pos in resp.choices[0].logprobs.top_logprobs)


@pytest.mark.parametrize("mode", ["auto", "vllite"])
def test_server_applies_model_defaults_to_unset_fields(model, mode):
    import openai

    folder, _, _ = model
    srv = ServerProcess([folder, "--dtype", "float32", "--num-kv-blocks", "64", "--logprobs-mode",
                         "processed_logprobs", "--generation-config", mode, "--served-model-name", "tiny"],
                        env={"VLLITE_LOG_LEVEL": "WARNING"})
    try:
        client = openai.OpenAI(base_url=srv.wait_ready() + "/v1", api_key="none")
        unset = _complete(client, extra_body={"ignore_eos": True})  # max_tokens: the completions default, 16
        own = _complete(client, temperature=1.0, max_tokens=8, extra_body={"top_k": 5, "ignore_eos": True})
    finally:
        srv.stop()
    if mode == "auto":
        assert "Default sampling parameters have been overridden" in srv.output
        assert unset.usage.completion_tokens == MAX_NEW  # max_new_tokens caps max_tokens (vLLM)
        assert all(_cut_off(unset)) and _most_finite(unset) <= TOP_K
    else:
        assert "Default sampling parameters" not in srv.output
        assert unset.usage.completion_tokens == 16
        assert not any(_cut_off(unset))
    assert own.usage.completion_tokens == (MAX_NEW if mode == "auto" else 8)
    assert not any(_cut_off(own))
