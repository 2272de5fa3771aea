"""Engine arguments as CLI flags: each EngineArgs field becomes --kebab-case, with vLLM's names."""
from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from typing import Any

from vllite_core.config import EngineArgs

_HELP = {
    "model": "model folder (config.json + safetensors), .gguf file, or Hugging Face Hub repo id (org/name, "
             "org/name-GGUF:Q4_K_M); default: the embedded SmolLM2-135M-Instruct",
    "revision": "Hub revision (branch, tag or commit) of a repo-id model",
    "download_dir": "folder for downloaded Hub models (default: the Hugging Face cache, HF_HOME)",
    "gguf_file": "the one GGUF file of a Hub repo (or model folder) to load",
    "generation_config": "default sampling parameters: auto (the model's generation_config.json), vllite (or vllm: "
                         "none), or a folder holding a generation_config.json",
    "dtype": "auto | float32 | bfloat16 | float16 (auto: the platform's preferred dtype)",
    "max_num_batched_tokens": "token budget of one step (prompt and output tokens alike)",
    "scheduling_policy": "fcfs | priority",
    "logprobs_mode": "raw_logprobs | processed_logprobs | raw_logits | processed_logits",
    "num_kv_blocks": "number of KV cache blocks (overrides memory profiling; alias --num-gpu-blocks-override)",
    "kv_cache_memory": "bytes of memory for the KV cache",
    "commit_kv_cache": "write every KV cache page at start-up, so the process holds its full footprint from the "
                       "start (default: pages are committed as blocks are first used; start-up takes longer)",
    "device": "platform name (default: VLLITE_PLATFORM or the best available)",
    "num_threads": "CPU threads for torch (default: all cores)",
    "enforce_eager": "disable graph capture / compilation",
    "enable_sleep_mode": "allow sleep(level) / wake_up(): release the KV cache (level 1) and the weights (level 2) "
                         "between uses and restore them (docs/sleep_mode.md)",
    "logits_processors": "global logits processor as module:attr (repeatable)",
    "runner": "auto | generate | pooling (pooling: embeddings / scores; auto: what the architecture is)",
    "quantization": "int8: linear weights quantized to int8 per output channel at load, activations per token "
                    "at run time (W8A8; the LM head stays in the model dtype); gguf: a GGUF checkpoint's Q8_0/Q4_0/"
                    "Q4_1 linear weights kept in their blocks and computed from them; compressed-tensors | fp8 | gptq "
                    "| awq: a pre-quantized checkpoint (detected from config.json's quantization_config when left out; "
                    "a different value is an error)",
    "model_impl": "auto | vllite | transformers: which implementation runs the model (vllite: a native one; "
                  "transformers: transformers' own class with vllite's paged attention, the Transformers fallback; "
                  "auto: native when one is registered, else the fallback)",
    "convert": "auto | none | embed | classify | reward: serve a causal LM as a pooling model",
    "jump_forward": "structured output: where the grammar allows exactly one token, append it without a "
                    "sampling step (outputs unchanged; requests asking for logprobs never jump)",
    "tensor_parallel_size": "shard the model over N ranks (one worker and one device each)",
    "pipeline_parallel_size": "split the model's layers over M pipeline stages of tensor_parallel_size ranks each "
                              "(world = tensor_parallel_size x pipeline_parallel_size; dense decoders)",
    "distributed_executor_backend": "uni (one worker in the engine process) | mp (one process per rank on this "
                                    "machine) | ray (Ray actors over a Ray cluster); default: uni for one rank, "
                                    "mp for more",
    "enable_expert_parallel": "mixture-of-experts models: place whole experts on the tensor-parallel ranks (an "
                              "equal share each; the experts must divide evenly) instead of splitting each one",
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        names = [flag]
        if f.name == "num_kv_blocks":
            names.append("--num-gpu-blocks-override")
        if f.name == "quantization":
            names.append("-q")
        if f.name == "enable_expert_parallel":
            names.append("-ep")
        if f.name == "gpu_memory_utilization":
            names.append("--memory-utilization")
        if f.name in ("tensor_parallel_size", "pipeline_parallel_size"):  # vLLM's short forms
            names.append("-tp" if f.name == "tensor_parallel_size" else "-pp")
        if f.name == "structured_outputs_config":
            group.add_argument("--structured-outputs-config", dest="structured_outputs_config", type=_json_object,
                               default=None, help="structured output settings as JSON (vLLM's): "
                               '\'{"backend": "auto", "disable_any_whitespace": true, ...}\'')
            group.add_argument("--structured-outputs-backend", dest="structured_outputs_backend", default=None,
                               help="structured output backend for the engine: auto | xgrammar | guidance | outlines")
            continue
        if f.name == "hf_overrides":
            group.add_argument("--hf-overrides", dest="hf_overrides", type=_json_object, default=None,
                               help="attributes to set on the model's transformers config, as JSON (vLLM's): "
                               '\'{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": '
                               '["no", "yes"], "is_original_qwen3_reranker": true}\'')
            continue
        if f.name == "speculative_config":
            group.add_argument("--speculative-config", dest="speculative_config", type=_json_object, default=None,
                               help="speculative decoding as JSON (vLLM's): '{\"method\": \"ngram\", "
                               '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}\'')
            continue
        if hint is bool:
            group.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                               help=_HELP.get(f.name))
            continue
        if typing.get_origin(hint) is list:
            group.add_argument(*names, dest=f.name, action="append", default=None, help=_HELP.get(f.name))
            continue
        base = str if f.name == "max_model_len" else _base_type(hint)  # 4096, 8k, 32K, -1, auto
        group.add_argument(*names, dest=f.name, type=base, default=f.default, help=_HELP.get(f.name))


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _base_type(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    t = args[0] if args else hint
    return t if t in (int, float, str) else str


def engine_args_from_namespace(ns: argparse.Namespace) -> EngineArgs:
    # An unset repeatable flag parses as None: leave the dataclass default (an empty list) in place.
    kwargs = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)
              if hasattr(ns, f.name) and not (f.name == "logits_processors" and getattr(ns, f.name) is None)
              and f.name != "structured_outputs_config"}
    so = dict(getattr(ns, "structured_outputs_config", None) or {})
    if getattr(ns, "structured_outputs_backend", None):
        so["backend"] = ns.structured_outputs_backend
    if so:
        kwargs["structured_outputs_config"] = so
    return EngineArgs(**kwargs)
