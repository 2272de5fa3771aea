"""`vllite plugins` and `vllite env`: what is installed, what loaded, which platform runs.

Both print plain text by default and JSON with ``--json``. ``vllite env`` prints
its diagnostics even when no platform can be resolved, then exits non-zero.
"""
from __future__ import annotations

import argparse
import json
import platform as pyplatform
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from vllite_core.errors import ConfigError
from vllite_core.platforms.resolve import (
    PlatformCandidate,
    PlatformResolutionError,
    ResolvedPlatform,
    diagnose_platforms,
    resolve_platform,
)
from vllite_core.plugins import VLLITE_PLUGIN_API, PluginError, list_plugins
from vllite_core.plugins.manager import get_plugin_manager, platform_plugin_failures

GiB = 1 << 30


def add_plugins_parser(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    p = subparsers.add_parser("plugins", help="list every discovered plugin: version, hooks, load status")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run_plugins)
    return p


def add_env_parser(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    p = subparsers.add_parser("env", help="show the platform this machine resolves to, and why")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--device", default=None, metavar="NAME",
                   help="resolve this platform explicitly (as the engine would with --device NAME)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="show the parallel layout an engine with N ranks would use here")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, metavar="M",
                   help="with M pipeline stages of N ranks each (with --model: which layers each stage holds; "
                        "a model with fewer layers than stages is refused)")
    p.add_argument("--distributed-executor-backend", default=None, choices=["uni", "mp", "ray"],
                   help="executor of that layout (default: uni for one rank, mp for more)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="show the process layout `vllite serve` would start with this many engine cores")
    p.add_argument("--model", default=None, metavar="MODEL",
                   help="also say which implementation would run this model (folder, .gguf or Hub repo id)")
    p.add_argument("--model-impl", default="auto", choices=["auto", "vllite", "transformers"],
                   help="the engine's --model-impl to resolve --model with (default: auto)")
    p.add_argument("--trust-remote-code", action="store_true", help="as the engine's --trust-remote-code")
    p.set_defaults(func=run_env)
    return p


def _versions() -> dict[str, str]:
    import torch

    try:
        core = version("vllite")
    except PackageNotFoundError:
        core = "unknown"
    return {"vllite": core, "plugin_api": "%d.%d" % VLLITE_PLUGIN_API, "torch": torch.__version__,
            "python": pyplatform.python_version()}


# ---- vllite plugins -------------------------------------------------------------------


def run_plugins(args: argparse.Namespace) -> int:
    infos = list_plugins()
    if args.json:
        print(json.dumps({**_versions(), "plugins": [i.to_dict() for i in infos]}, indent=2))
        return 0
    v = _versions()
    print(f"vllite {v['vllite']} (plugin API {v['plugin_api']})")
    if not infos:
        print("no plugins found")
        return 0
    rows = [("NAME", "GROUP", "DISTRIBUTION", "VERSION", "HOOKS", "STATUS")]
    for i in infos:
        status = i.status if i.status == "loaded" else f"{i.status}: {i.reason}"
        rows.append((i.name, i.group, i.distribution, i.version, ",".join(i.hooks) or "-", status))
    print(_table(rows))
    return 0


# ---- vllite env -----------------------------------------------------------------------


def _candidate_line(c: PlatformCandidate, chosen: bool) -> str:
    state = "chosen" if chosen else ("available" if c.available else "unavailable")
    detail = c.error or c.reason
    return f"  {c.name:<10} {c.distribution} {c.version}  priority {c.priority:<4} {state}: {detail}"


def _env_report(resolved: ResolvedPlatform | None, candidates: list[PlatformCandidate],
                error: str | None) -> dict[str, Any]:
    failed = [f.to_dict() for f in platform_plugin_failures(get_plugin_manager())]
    report: dict[str, Any] = {**_versions(), "platform": None, "reason": None, "error": error,
                              "candidates": [c.to_dict() for c in candidates], "failed_platform_plugins": failed}
    if resolved is not None:
        facts = resolved.platform.describe()
        chosen = resolved.chosen
        if chosen is not None:
            facts["distribution"], facts["version"] = chosen.distribution, chosen.version
        report["platform"], report["reason"] = facts, resolved.reason
    return report


def _add_layout(report: dict[str, Any], resolved: ResolvedPlatform | None, args: argparse.Namespace) -> str | None:
    """The planned parallel layout into ``report``; a bad setting's message (ConfigError) instead."""
    from vllite_core.distributed.layout import planned_layout

    if resolved is None:
        return None
    hf_config = model_cls = None
    if args.model is not None:  # the model's layers and heads checked against the layout
        hf_config, model_cls = _layout_model(args)
    try:
        report["parallel"] = planned_layout(resolved.platform, args.tensor_parallel_size,
                                            args.distributed_executor_backend, args.pipeline_parallel_size,
                                            hf_config, model_cls)
    except ConfigError as e:
        return str(e)
    return None


def _layout_model(args: argparse.Namespace) -> tuple[Any, Any]:
    """(hf_config, model class) of ``--model``, or (None, None) when it does not resolve (the model report says
    why)."""
    from model_registry.model_impl import resolve_model_impl
    from model_registry.registry import build_registry
    from model_registry.source import load_hf_config, resolve_model_source

    try:
        hf_config = load_hf_config(resolve_model_source(args.model), args.trust_remote_code)
        choice = resolve_model_impl(build_registry(get_plugin_manager()), hf_config, args.model_impl,
                                    args.trust_remote_code)
    except (ValueError, OSError, ImportError):
        return None, None
    return hf_config, choice.model_cls
def _process_layout(data_parallel_size: int) -> dict[str, Any]:
    """What `vllite serve` starts (VLLITE_ENABLE_V1_MULTIPROCESSING decides) and where the offline LLM runs."""
    from vllite_core.engine.core_client import multiprocessing_enabled

    mp = multiprocessing_enabled(default=True)
    if mp:
        ranks = ", ".join(f"DP rank {r}" for r in range(data_parallel_size))
        serve = (f"vllite serve: API server process + {data_parallel_size} engine core "
                 f"process{'es' if data_parallel_size != 1 else ''} ({ranks}), ZMQ ipc + msgpack")
    else:
        serve = "vllite serve: API server and engine core in one process (VLLITE_ENABLE_V1_MULTIPROCESSING=0)"
    return {"multiprocessing": mp, "data_parallel_size": data_parallel_size, "serve": serve,
            "offline": "in-process (engine core in the caller's process)"}


def _model_report(args: argparse.Namespace) -> dict[str, Any]:
    """Which implementation runs ``--model`` (``model_registry.model_impl``), or why none can."""
    from model_registry.model_impl import resolve_model_impl
    from model_registry.registry import build_registry
    from model_registry.source import load_hf_config, resolve_model_source

    report: dict[str, Any] = {"model": args.model, "architecture": None, "model_impl": None, "reason": None,
                              "class": None, "error": None}
    try:
        hf_config = load_hf_config(resolve_model_source(args.model), args.trust_remote_code)
        choice = resolve_model_impl(build_registry(get_plugin_manager()), hf_config, args.model_impl,
                                    args.trust_remote_code)
    except (ValueError, OSError, ImportError) as e:
        report["error"] = str(e)
        return report
    cls = getattr(choice.model_cls, "hf_class", choice.model_cls)
    report.update(architecture=choice.architecture, model_impl=choice.impl, reason=choice.reason,
                  **{"class": f"{cls.__module__}.{cls.__name__}"})
    return report


def run_env(args: argparse.Namespace) -> int:
    resolved: ResolvedPlatform | None = None
    error: str | None = None
    try:
        resolved = resolve_platform(args.device)
        candidates = resolved.candidates
    except PlatformResolutionError as exc:
        error, candidates = str(exc), exc.candidates
    except PluginError as exc:
        error, candidates = str(exc), diagnose_platforms()
    report = _env_report(resolved, candidates, error)
    error = _add_layout(report, resolved, args) or error
    report["process_layout"] = _process_layout(args.data_parallel_size)
    if args.model is not None:
        report["model"] = _model_report(args)
        error = error or report["model"]["error"]
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        _print_env(report, resolved, candidates)
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


def _print_env(report: dict[str, Any], resolved: ResolvedPlatform | None,
               candidates: list[PlatformCandidate]) -> None:
    facts = report["platform"]
    if facts is not None:
        print(f"platform:      {facts['name']} ({facts.get('distribution', '?')} {facts.get('version', '')})".rstrip())
        print(f"chosen:        {report['reason']}")
        print(f"device:        {facts['device_name']} ({facts['device_type']})")
        print(f"devices:       {', '.join(facts['devices']) or '-'}")
        print(f"memory:        {facts['total_memory'] / GiB:.1f} GiB")
        print(f"dtypes:        {', '.join(facts['supported_dtypes'])}")
        print(f"kv dtypes:     {', '.join(facts['kv_cache_dtypes'])}")
        print(f"dist backend:  {facts['dist_backend']}")
        if "parallel" in report:
            from vllite_core.distributed.layout import format_layout

            print("\n".join(format_layout(report["parallel"])))
    else:
        print("platform:      none resolved")
    if "model" in report:
        m = report["model"]
        print(f"model:         {m['model']}" + (f" ({m['architecture']})" if m["architecture"] else ""))
        if m["error"] is None:
            what = "native" if m["model_impl"] == "vllite" else "Transformers fallback"
            print(f"model_impl:    {m['model_impl']} ({what}, {m['class']}): {m['reason']}")
        else:
            print(f"model_impl:    none: {m['error']}")
    lay = report["process_layout"]
    print(f"processes:     {lay['serve']}")
    print(f"               offline LLM: {lay['offline']}")
    print(f"torch:         {report['torch']}")
    print(f"vllite:        {report['vllite']} (plugin API {report['plugin_api']}), python {report['python']}")
    chosen_cls = type(resolved.platform) if resolved is not None else None
    print("candidates:")
    if not candidates:
        print("  (no platform plugin found)")
    for c in candidates:
        print(_candidate_line(c, c.cls is not None and c.cls is chosen_cls))
    for f in report["failed_platform_plugins"]:
        print(f"  {f['name']:<10} {f['distribution']} {f['version']}  {f['status']}: {f['reason']}")


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows)
