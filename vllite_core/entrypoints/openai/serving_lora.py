"""Adapters served by name: ``--lora-modules`` at start, and (only when the operator allows runtime
updates) ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.

A request's ``model`` field picks an adapter by the name it is served under; nothing in a request
ever names a path. The load endpoint does take a path, so it exists only with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (or ``VLLITE_ALLOW_RUNTIME_LORA_UPDATING``) set, and reads only
directories inside ``--lora-allowed-root`` (symlinks resolved): without that root every load is refused.
"""
from __future__ import annotations

import itertools
import json
import os
import threading
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from vllite_core.entrypoints.openai.errors import APIError, bad_request
from vllite_core.entrypoints.openai.lora_checks import DEFAULT_MAX_LORA_BYTES, check_adapter_dir, check_lora_name
from vllite_core.entrypoints.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from vllite_core.entrypoints.openai.serving_common import server_state
from vllite_core.lora.errors import LoRAError
from vllite_core.lora.request import LoRARequest

RUNTIME_ENV = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "VLLITE_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_updates_allowed(environ: Any = os.environ) -> bool:
    return any(environ.get(k, "").strip().lower() in ("1", "true", "yes", "on") for k in RUNTIME_ENV)


@dataclass
class LoRAModulePath:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """``name=path`` or vLLM's JSON form ``{"name": ..., "path": ..., "base_model_name": ...}``."""
    text = text.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
            return LoRAModulePath(str(obj["name"]), str(obj["path"]), obj.get("base_model_name"))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--lora-modules: {text!r} is not {{\"name\": ..., \"path\": ...}} ({e})") from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules: {text!r} is not name=path")
    return LoRAModulePath(name, path)


class ServedLoRAs:
    """Adapter name -> LoRARequest, each with its own ``lora_int_id`` (a reload is a new id: new KV)."""

    def __init__(self, engine: Any, base_name: str, modules: list[LoRAModulePath], allowed_root: str | None = None,
                 runtime_updates: bool = False) -> None:
        self.engine = engine  # AsyncLLM
        self.base_name = base_name
        self.allowed_root = os.path.realpath(allowed_root) if allowed_root else None
        self.runtime_updates = runtime_updates
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.requests: dict[str, LoRARequest] = {}
        self.parents: dict[str, str] = {}
        self.served_names: set[str] = {base_name}  # every --served-model-name: no adapter may take one over
        self.max_adapter_bytes = DEFAULT_MAX_LORA_BYTES
        for m in modules:
            self.add(m.name, m.path, m.base_model_name)

    def registry(self) -> Any:
        reg = self.engine.engine.lora_registry
        if reg is None:
            raise bad_request("LoRA is not enabled on this server (start it with --enable-lora)", "model")
        return reg

    def add(self, name: str, path: str, parent: str | None = None) -> LoRARequest:
        """Load and check the adapter now (LoRAError naming the field), then serve it as ``name``."""
        with self._lock:
            req = LoRARequest(name, next(self._ids), path)
        self.registry().resolve(req)
        with self._lock:
            self.requests[name] = req
            self.parents[name] = parent or self.base_name
        return req

    def get(self, name: str | None) -> LoRARequest | None:
        return self.requests.get(name) if name is not None else None

    def remove(self, name: str) -> None:
        with self._lock:
            req = self.requests.pop(name)
            self.parents.pop(name, None)
        self.registry().remove(req.lora_int_id)  # running requests keep the adapter they hold
        core = self.engine.engine.core
        if hasattr(core, "remove_lora"):  # engine cores in their own processes keep a cache of their own
            core.remove_lora(req.lora_int_id)

    def models(self, created: int, max_model_len: int) -> list[dict[str, Any]]:
        return [{"id": name, "object": "model", "created": created, "owned_by": "vllite", "root": req.lora_path,
                 "parent": self.parents[name], "max_model_len": max_model_len}
                for name, req in list(self.requests.items())]

    def check_path(self, path: str) -> str:
        if self.allowed_root is None:
            raise bad_request("runtime adapter loads need the server started with --lora-allowed-root DIR",
                              "lora_path")
        real = os.path.realpath(path)
        if os.path.commonpath([real, self.allowed_root]) != self.allowed_root:
            raise bad_request(f"{path!r} is not inside the server's --lora-allowed-root", "lora_path")
        return real


runtime_router = APIRouter()  # included only when the operator allowed runtime adapter updates


@runtime_router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> PlainTextResponse:
    state = server_state(request)
    loras: ServedLoRAs = state.loras
    req = await state.read_body(request, LoadLoRAAdapterRequest)
    check_lora_name(req.lora_name, {*loras.requests, loras.base_name, *loras.served_names})
    path = loras.check_path(req.lora_path)
    assert loras.allowed_root is not None  # check_path refused otherwise
    check_adapter_dir(path, loras.allowed_root, loras.max_adapter_bytes)
    try:
        await loras.engine.run_prep(loras.add, req.lora_name, path)
    except LoRAError as e:
        raise bad_request(str(e), e.param) from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@runtime_router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    state = server_state(request)
    loras: ServedLoRAs = state.loras
    req = await state.read_body(request, UnloadLoRAAdapterRequest)
    if req.lora_name not in loras.requests:
        raise APIError(404, f"no adapter named {req.lora_name!r} is served", "lora_name", "model_not_found")
    loras.remove(req.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
