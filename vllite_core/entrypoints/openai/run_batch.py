"""OpenAI batch files through the server's own routes, in one process (``vllite run-batch``).

Each input line is ``{"custom_id", "method": "POST", "url", "body"}`` for /v1/completions,
/v1/chat/completions or /v1/embeddings. The lines go to the FastAPI app that ``vllite serve`` runs
(through an in-process ASGI transport, no socket), all at once up to a concurrency bound, so the
engine batches them and every validation and response is exactly the server's. Each output line
(in input order) is ``{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}``: a refused request keeps its status and error body in ``response`` and its error in
``error``; a line that is not a request at all (bad JSON, no url...) gets ``response: null`` and the
error. No line stops the batch.
"""
from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from typing import Any, Callable

URLS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")
DEFAULT_CONCURRENCY = 256


@dataclass
class BatchLine:
    """One input line: the request it holds, or why it holds none."""

    custom_id: str | None
    url: str | None = None
    body: dict[str, Any] | None = None
    error: str | None = None


def parse_line(text: str, number: int) -> BatchLine:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return BatchLine(None, error=f"line {number}: not JSON: {e}")
    if not isinstance(obj, dict):
        return BatchLine(None, error=f"line {number}: a batch line must be a JSON object")
    cid = obj.get("custom_id")
    cid = cid if isinstance(cid, str) else None
    extra = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if cid is None:
        return BatchLine(None, error=f"line {number}: custom_id (a string) is missing")
    if extra:
        return BatchLine(cid, error=f"line {number}: unrecognized field {extra[0]!r}")
    if obj.get("method", "POST") != "POST":
        return BatchLine(cid, error=f"line {number}: method must be POST, got {obj.get('method')!r}")
    url = obj.get("url")
    if url not in URLS:
        return BatchLine(cid, error=f"line {number}: url must be one of {', '.join(URLS)}, got {url!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        return BatchLine(cid, error=f"line {number}: body must be a JSON object")
    if body.get("stream"):
        return BatchLine(cid, error=f"line {number}: stream is not supported in a batch")
    return BatchLine(cid, url, body)


def output_line(line: BatchLine, status: int | None, body: Any) -> dict[str, Any]:
    rid = f"batch_req_{uuid.uuid4().hex}"
    if status is None:  # not a request: nothing was sent
        return {"id": rid, "custom_id": line.custom_id, "response": None,
                "error": {"code": "invalid_batch_line", "message": line.error}}
    error = None
    if status >= 400:
        err = body.get("error") if isinstance(body, dict) else None
        error = {"code": (err or {}).get("code") or str(status), "message": (err or {}).get("message") or str(body)}
    return {"id": rid, "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": rid, "body": body}, "error": error}


async def run_lines(app: Any, lines: list[BatchLine], concurrency: int = DEFAULT_CONCURRENCY,
                    on_done: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """Every line's output line, in order, each request sent to ``app`` (an ASGI app)."""
    import httpx

    gate = asyncio.Semaphore(concurrency)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://run-batch", timeout=None) as client:
        async def one(line: BatchLine) -> dict[str, Any]:
            try:
                if line.error is not None:
                    return output_line(line, None, None)
                async with gate:
                    r = await client.post(line.url or "", json=line.body)
                try:
                    body = r.json()
                except ValueError:
                    body = {"error": {"message": r.text, "code": str(r.status_code)}}
                return output_line(line, r.status_code, body)
            finally:
                if on_done is not None:
                    on_done()

        return list(await asyncio.gather(*(one(line) for line in lines)))


def run_batch_file(app: Any, input_path: str, output_path: str, concurrency: int = DEFAULT_CONCURRENCY,
                   progress: bool = True) -> tuple[int, int]:
    """Read ``input_path``, write ``output_path``; (lines, failed lines)."""
    from tqdm import tqdm

    with open(input_path, encoding="utf-8") as f:
        texts = [(i + 1, t) for i, t in enumerate(f) if t.strip()]
    lines = [parse_line(t, n) for n, t in texts]
    bar = tqdm(total=len(lines), desc="run-batch", unit="req", disable=not progress)
    try:
        outs = asyncio.run(run_lines(app, lines, concurrency, bar.update))
    finally:
        bar.close()
    with open(output_path, "w", encoding="utf-8") as f:
        for o in outs:
            f.write(json.dumps(o, ensure_ascii=False) + "\n")
    return len(outs), sum(1 for o in outs if o["error"] is not None)
