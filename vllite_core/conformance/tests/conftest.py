"""Fixtures of the conformance kit: the platform under test, its device, backend and dtype."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from vllite_core.config import VlliteConfig  # noqa: E402

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        item.add_marker("vllite_conformance")


@pytest.fixture(scope="session")
def platform_name(pytestconfig) -> str:
    return pytestconfig.getoption("vllite_platform")


@pytest.fixture(scope="session")
def resolution(platform_name):
    """The platform, resolved exactly as the engine would (explicit name); fails if its device is absent."""
    from vllite_core.platforms.resolve import resolve_platform

    return resolve_platform(platform_name)


@pytest.fixture(scope="session")
def platform(resolution):
    p = resolution.platform
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") and p.device_type != "cpu":
        raise pytest.UsageError(
            "TRITON_INTERPRET is set: Triton kernels would run in the CPU interpreter instead of on the "
            f"{p.name} device. Unset it (a conftest.py of the project you run from may set it: run the kit "
            "from another folder).")
    p.init_device(VlliteConfig())
    return p


@pytest.fixture(scope="session")
def device(platform) -> torch.device:
    return platform.device()


@pytest.fixture(scope="session")
def model_dtype(pytestconfig, platform) -> torch.dtype:
    """float32 where supported (so greedy tokens can be held to Hugging Face's), else the platform default."""
    asked = pytestconfig.getoption("vllite_dtype")
    if asked:
        if asked not in _DTYPES:
            raise pytest.UsageError(f"--vllite-dtype: one of {', '.join(_DTYPES)}, got {asked!r}")
        return _DTYPES[asked]
    return torch.float32 if torch.float32 in platform.supported_dtypes() else platform.default_dtype()


@pytest.fixture(scope="session")
def backend(platform):
    return platform.get_attention_backend(VlliteConfig())


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
