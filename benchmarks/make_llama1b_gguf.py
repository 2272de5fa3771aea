#!/usr/bin/env python3
"""The Llama-3.2-1B-shaped checkpoint (``make_llama1b.py``) as GGUF files, for the comparison with llama.cpp
(``gguf_vs_llama_cpp.py``):

- ``<out>/llama1b-f16.gguf``: written here as llama.cpp's converter lays a Llama out (tensor names, q/k rows
  permuted for its rotary layout, F32 norms, F16 matrices), with the tokenizer metadata of the embedded
  SmolLM2 GGUF (the checkpoint uses SmolLM2's tokenizer). Plain RoPE: the llama3 rope scaling is left out (a
  ``rope_freqs`` tensor, which transformers and vllite ignore), so both engines compute the same model;
  at 128 + 128 positions it changes nothing of the speed.
- ``<out>/llama1b-q4_k_m.gguf``: what llama.cpp's own quantizer makes of it (``llama_model_quantize``,
  ``Q4_K_M``: Q4_K with Q6_K for half the attn_v / ffn_down tensors and the output), run in the
  llama-cpp-python venv of ``../shared/peers/setup_llama_cpp.sh``.

    .venv/bin/python benchmarks/make_llama1b_gguf.py [--src /tmp/peers/models/llama1b] [--out /tmp/peers/models]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess

import numpy as np

LLAMA_VENV = "/tmp/peers/llama-venv/bin/python"
QUANTIZE = """
import ctypes, sys, llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
p.nthread = 2
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p))
sys.exit(rc)
"""


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's rotary layout for the q/k rows of a "llama" model (the converter's permutation)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _gguf_name(name: str) -> str:
    if name.startswith("model.layers."):
        _, _, layer, rest = name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        return f"blk.{layer}.{_NAMES[module]}.{kind}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[name]


def _copy_tokenizer(writer, source: str) -> None:
    from gguf import GGUFReader, GGUFValueType

    for key, field in GGUFReader(source).fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype == GGUFValueType.ARRAY:
            writer.add_key_value(key, field.contents(), vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, field.contents(), vtype)


def write_f16(src: str, path: str) -> None:
    from gguf import GGMLQuantizationType, GGUFWriter
    from safetensors import safe_open

    from model_registry.source import resolve_model_source

    with open(os.path.join(src, "config.json")) as f:
        c = json.load(f)
    w = GGUFWriter(path, "llama")
    w.add_name("llama1b-shaped random")
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_rope_dimension_count(c["head_dim"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(c["rope_parameters"]["rope_theta"])
    w.add_vocab_size(c["vocab_size"])
    w.add_file_type(1)  # mostly F16
    _copy_tokenizer(w, resolve_model_source(None).gguf_file)
    with safe_open(os.path.join(src, "model.safetensors"), "pt") as st:
        for name in st.keys():
            data = st.get_tensor(name).float().numpy()
            gname = _gguf_name(name)
            if ".attn_q." in gname:
                data = _permute(data, c["num_attention_heads"])
            elif ".attn_k." in gname:
                data = _permute(data, c["num_key_value_heads"])
            if data.ndim == 1:
                w.add_tensor(gname, data.astype(np.float32), raw_dtype=GGMLQuantizationType.F32)
            else:
                w.add_tensor(gname, data.astype(np.float16), raw_dtype=GGMLQuantizationType.F16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", default="/tmp/peers/models/llama1b")
    p.add_argument("--out", default="/tmp/peers/models")
    args = p.parse_args()
    f16 = os.path.join(args.out, "llama1b-f16.gguf")
    q4 = os.path.join(args.out, "llama1b-q4_k_m.gguf")
    write_f16(args.src, f16)
    subprocess.run([LLAMA_VENV, "-c", QUANTIZE, f16, q4], check=True)
    for f in (f16, q4):
        print(f"{f}: {os.path.getsize(f) / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
