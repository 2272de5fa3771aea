"""The platform conformance kit: the CPU platform and the example vendor platform (acme) pass it, as a
platform package's CI would run it (`pytest --vllite-platform NAME` in a fresh process); the plugin adds
nothing to a run without that option; and the kit's attention check catches a wrong backend."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from plugin_fakes import REPO, fresh_plugins  # noqa: F401

from vllite_core.attention.reference import ReferenceAttention
from vllite_core.conformance.kit import STANDARD_CASES, assert_attention_matches, run_attention_case
from vllite_core.conformance.pytest_plugin import KIT_DIR

torch.set_num_threads(2)
PLUGIN = "vllite_core.conformance.pytest_plugin"


def _pytest(args: list[str], cwd, threads: int = 1, **env: str) -> subprocess.Popen:
    full = {k: v for k, v in os.environ.items() if k not in ("VLLITE_PLATFORM", "VLLITE_PLUGINS", "TRITON_INTERPRET")}
    full.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                OMP_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", **env)
    # Autoload off and `-p` given: the way a vendor's CI pins the plugin explicitly.
    return subprocess.Popen([sys.executable, "-m", "pytest", "-p", PLUGIN, "-p", "no:cacheprovider", "-q", *args],
                            cwd=cwd, env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _summary(output: str) -> str:
    return output.strip().splitlines()[-1] if output.strip() else ""


def test_cpu_and_acme_pass_the_kit(tmp_path):
    """Both runs at once (one thread each): the whole kit, engine included, on each platform."""
    runs = {}
    for name in ("cpu", "acme"):
        (tmp_path / name).mkdir()
        runs[name] = _pytest(["--vllite-platform", name, "-rs"], tmp_path / name)
    outputs = {name: proc.communicate(timeout=600)[0] for name, proc in runs.items()}
    for name, proc in runs.items():
        out = outputs[name]
        assert proc.returncode == 0, f"conformance kit failed on {name}:\n{out[-6000:]}"
        last = _summary(out)
        assert " passed" in last and "failed" not in last and "error" not in last, last
    # acme exercises the optional parts the CPU platform skips: graph capture and fp8 KV caches.
    assert "captures no graphs" not in outputs["acme"] and "no fp8 KV cache" not in outputs["acme"]


def test_plugin_adds_nothing_without_the_option(tmp_path):
    """Without --vllite-platform: the kit's own folder collects nothing, other tests run as usual, and the
    kit's options exist (an unknown option would be a usage error)."""
    (tmp_path / "test_one.py").write_text("def test_one():\n    assert True\n")
    proc = _pytest(["test_one.py", KIT_DIR, "--vllite-dtype", "float32"], tmp_path)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0 and _summary(out).startswith("1 passed"), out


class _OffByOne(ReferenceAttention):
    """A subtly wrong backend: outputs 0.1% too large (well outside float32 tolerance)."""

    def forward(self, query, key, value, kv_cache, metadata, scale, sliding_window=None):
        out = super().forward(query, key, value, kv_cache, metadata, scale, sliding_window)
        return out * (1 + 1e-3)


def test_kit_catches_a_wrong_backend():
    case = next(c for c in STANDARD_CASES if c.name == "prefill")
    with pytest.raises(AssertionError, match="step 'prefill'"):
        assert_attention_matches(run_attention_case(_OffByOne(), case, "cpu"), torch.float32)
    assert_attention_matches(run_attention_case(ReferenceAttention(), case, "cpu"), torch.float32)


def test_acme_is_selected_by_vllite_platform(fresh_plugins, monkeypatch):  # noqa: F811
    from vllite_core.platforms import PlatformResolutionError, resolve_platform

    assert resolve_platform().platform.name == "cpu"  # priority -5: never chosen on its own
    monkeypatch.setenv("VLLITE_PLATFORM", "acme")
    res = resolve_platform()
    assert res.platform.name == "acme" and res.chosen.distribution == "vllite-platform-acme"
    assert "VLLITE_PLATFORM=acme" in res.reason
    monkeypatch.setenv("ACME_VISIBLE_DEVICES", "")  # the device hidden: never selected
    with pytest.raises(PlatformResolutionError, match="not available"):
        resolve_platform()


def test_kit_moe_check_catches_a_wrong_op():
    """The torch default passes every MoE case; an op that drops the routing weights, or one that runs every
    expert (reading the never-chosen ones, NaN), fails them."""
    from vllite_core.conformance.kit import MOE_CASES, run_moe_case, tolerance
    from vllite_core.model_ops import ModelOps

    class Unweighted(ModelOps):
        def fused_moe(self, x, w13, w2, topk_weights, topk_ids, state=None):
            return super().fused_moe(x, w13, w2, torch.ones_like(topk_weights), topk_ids, state)

    class EveryExpert(ModelOps):
        def fused_moe(self, x, w13, w2, topk_weights, topk_ids, state=None):
            out = super().fused_moe(x, w13, w2, topk_weights, topk_ids, state)
            return out + 0 * torch.einsum("eih,th->ti", w13, x).sum(-1, keepdim=True)

    atol, rtol = tolerance(torch.float32)
    for case in MOE_CASES:
        out, ref = run_moe_case(ModelOps(), case, "cpu", torch.float32)
        torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
        for wrong in (Unweighted(), EveryExpert()):
            with pytest.raises(AssertionError):
                out, ref = run_moe_case(wrong, case, "cpu", torch.float32)
                torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
