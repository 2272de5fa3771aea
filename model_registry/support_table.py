"""The supported-architectures table of docs/models.md, generated from the model registry (never written by hand):
for each built-in architecture, its class, the GGUF architectures that load into it, and what the class declares
(tensor parallelism, LoRA) or computes from a default config of its family (the CPU platform's fused decoder layer).
``scripts/models_table.py`` writes it into the doc; tests/test_models_table.py fails when the doc is stale."""
from __future__ import annotations

from dataclasses import dataclass

BEGIN, END = "<!-- supported-architectures:begin -->", "<!-- supported-architectures:end -->"


@dataclass(frozen=True)
class SupportRow:
    architecture: str
    target: str
    gguf: tuple[str, ...]
    tensor_parallel: bool
    lora: bool
    fused_cpu: str  # "yes", "no: <reason>", or "-" (the class offers no fused decoder layer)


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


def support_rows() -> list[SupportRow]:
    from model_registry.builtin import vllite_register_models
    from model_registry.gguf_config import GGUF_ARCHITECTURES
    from model_registry.registry import ModelRegistry
    from vllite_core.model_interfaces import SupportsLoRA, SupportsTensorParallel

    registry = ModelRegistry()
    vllite_register_models(registry)
    rows = []
    for arch in registry.architectures():
        cls = registry.resolve(arch)
        gguf = tuple(sorted(g for g, (_, a) in GGUF_ARCHITECTURES.items() if a == arch))
        fused = "-"
        probe = getattr(cls, "fused_cpu_path", None)
        config = _default_config(arch) if probe is not None else None
        if probe is not None and config is not None:
            why = probe(config)
            fused = "yes" if why is None else "no: " + why.split(": ", 1)[-1]
        target = registry.entry(arch).target
        rows.append(SupportRow(arch, target if isinstance(target, str) else f"{cls.__module__}:{cls.__name__}", gguf,
                               _tensor_parallel(cls, arch, SupportsTensorParallel), SupportsLoRA in cls.__mro__,
                               fused))
    return rows


def render(rows: list[SupportRow]) -> str:
    """The markdown table between the doc's markers."""
    yes = {True: "yes", False: "-"}
    lines = [BEGIN, "| architecture | implementation | GGUF | TP | LoRA | CPU fused decoder layer |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r.architecture}` | `{r.target.split(':')[0].rsplit('.', 1)[-1]}` | "
                     f"{', '.join(r.gguf) or '-'} | {yes[r.tensor_parallel]} | {yes[r.lora]} | {r.fused_cpu} |")
    lines.append(END)
    return "\n".join(lines)


def updated_doc(text: str, table: str) -> str:
    """``text`` with the block between the markers replaced by ``table``."""
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + table + text[end:]
