"""A request-body model for tests/server/test_body_parser.py, in a module the parse helper process imports
quickly (pydantic only): which process validated a body rides along as ``pid``, and whether torch
was imported there as ``torch_loaded``."""
from __future__ import annotations

import os
import sys

from pydantic import BaseModel, ConfigDict, Field


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: list[int]
    max_tokens: int = 16
    pid: int = Field(default_factory=os.getpid)
    torch_loaded: bool = Field(default_factory=lambda: "torch" in sys.modules)
