"""The OpenAPI ``requestBody`` of a route that reads its JSON body by hand (``ServerState.read_body``,
so that a 400 names the field in the engine's words): clients and fuzzers still see its schema."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel


def openapi_body(model: type[BaseModel]) -> dict[str, Any]:
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}
