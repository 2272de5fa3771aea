"""The supported-architectures table of docs/models.md, generated from the model registry (never written by hand):
for each built-in architecture, its class, the GGUF architectures that load into it, what the class declares
(tensor parallelism, pipeline stages, LoRA) or computes from a default config of its family (the CPU platform's
fused decoder layer), and whether the Transformers fallback (``model_impl="transformers"``) takes it; then rows for the
architectures only the fallback runs that its tests prove (``FALLBACK_TESTED``), their columns computed the same
way from the fallback's class. ``scripts/models_table.py`` writes it into the doc; tests/models/test_models_table.py
fails when the doc is stale."""
from __future__ import annotations

from dataclasses import dataclass

BEGIN, END = "<!-- supported-architectures:begin -->", "<!-- supported-architectures:end -->"
# Architectures tests/models/test_transformers_fallback.py runs through the fallback against HF generate (or, Llama, its
# native run); the first two have no native class and get rows of their own.
FALLBACK_ONLY_TESTED = ("GPTNeoXForCausalLM", "OPTForCausalLM")
FALLBACK_TESTED = (*FALLBACK_ONLY_TESTED, "LlamaForCausalLM", "MistralForCausalLM")
FALLBACK_TARGET = "model_registry.models.transformers_fallback:TransformersForCausalLM"


@dataclass(frozen=True)
class SupportRow:
    architecture: str
    target: str
    gguf: tuple[str, ...]
    tensor_parallel: bool
    pipeline_parallel: bool  # the class builds only its stage's layers (``supports_pipeline_parallel``)
    lora: bool
    fused_cpu: str  # "yes", "no: <reason>", or "-" (the class offers no fused decoder layer)
    fallback: str  # "tested", "accepted" (its checks pass, no test runs it), "no: <reason>", or "-" (not a
    # transformers causal LM: the fallback does not apply)


def _default_config(architecture: str) -> object | None:
    """transformers' default config of the model type whose causal LM class is ``architecture``."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = next((t for t, name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if name == architecture), None)
    return None if model_type is None else AutoConfig.for_model(model_type)


def _tensor_parallel(cls: type, arch: str, protocol: type) -> bool:
    """Declared, and not refused for two ranks by the family's own check on its default config."""
    if protocol not in cls.__mro__:
        return False
    check = getattr(cls, "check_tensor_parallel", None)
    config = _default_config(arch) if check is not None else None
    if config is None:
        return True
    try:
        check(config, 2)
    except Exception:  # noqa: BLE001 - any refusal means "not on two ranks"
        return False
    return True


def _stages(cls: type) -> bool:
    return bool(getattr(cls, "supports_pipeline_parallel", False))


def _fallback(arch: str) -> tuple[type | None, str]:
    """The fallback's engine class for ``arch``'s default config and "tested" or "accepted", or None and why not
    ("-": not a transformers causal LM at all)."""
    from model_registry.models.transformers_fallback import FallbackUnavailableError, fallback_model_class

    config = _default_config(arch)
    if config is None:
        return None, "-"
    config.architectures = [arch]
    try:
        return fallback_model_class(config, trust_remote_code=False), (
            "tested" if arch in FALLBACK_TESTED else "accepted")
    except FallbackUnavailableError as e:
        why = str(e).removeprefix(arch).lstrip(": ").split(" (")[0].split(", ")[0].split("; ")[0]
        return None, f"no: {why}"


def support_rows() -> list[SupportRow]:
    from model_registry.builtin import vllite_register_models
    from model_registry.gguf_config import GGUF_ARCHITECTURES, GGUF_EXPERT_ARCHITECTURES
    from model_registry.registry import ModelRegistry
    from vllite_core.model_interfaces import SupportsLoRA, SupportsTensorParallel

    registry = ModelRegistry()
    vllite_register_models(registry)
    rows = []
    for arch in registry.architectures():
        cls = registry.resolve(arch)
        gguf = tuple(sorted([g for g, (_, a) in GGUF_ARCHITECTURES.items() if a == arch]
                            + [f"{g} (experts)" for g, (_, a) in GGUF_EXPERT_ARCHITECTURES.items() if a == arch]))
        fused = "-"
        probe = getattr(cls, "fused_cpu_path", None)
        config = _default_config(arch) if probe is not None else None
        if probe is not None and config is not None:
            why = probe(config)
            fused = "yes" if why is None else "no: " + why.split(": ", 1)[-1]
        target = registry.entry(arch).target
        rows.append(SupportRow(arch, target if isinstance(target, str) else f"{cls.__module__}:{cls.__name__}", gguf,
                               _tensor_parallel(cls, arch, SupportsTensorParallel), _stages(cls),
                               SupportsLoRA in cls.__mro__, fused, _fallback(arch)[1]))
    for arch in FALLBACK_ONLY_TESTED:
        cls, fallback = _fallback(arch)
        if cls is None:
            raise RuntimeError(f"{arch}: the Transformers fallback no longer takes it ({fallback})")
        rows.append(SupportRow(arch, FALLBACK_TARGET, (), _tensor_parallel(cls, arch, SupportsTensorParallel),
                               _stages(cls), SupportsLoRA in cls.__mro__, "-", fallback))
    return rows


def render(rows: list[SupportRow]) -> str:
    """The markdown table between the doc's markers."""
    yes = {True: "yes", False: "-"}
    lines = [BEGIN, "| architecture | implementation | GGUF | TP | PP | LoRA | CPU fused decoder layer | "
             "Transformers fallback |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r.architecture}` | `{r.target.split(':')[0].rsplit('.', 1)[-1]}` | "
                     f"{', '.join(r.gguf) or '-'} | {yes[r.tensor_parallel]} | {yes[r.pipeline_parallel]} | "
                     f"{yes[r.lora]} | {r.fused_cpu} | {r.fallback} |")
    lines.append(END)
    return "\n".join(lines)


def updated_doc(text: str, table: str) -> str:
    """``text`` with the block between the markers replaced by ``table``."""
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + table + text[end:]
