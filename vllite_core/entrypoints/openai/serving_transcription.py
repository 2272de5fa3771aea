"""POST /v1/audio/transcriptions: a multipart audio upload -> its text (OpenAI's shape).

Form fields: ``file`` (required; WAV, decoded with the standard library and
resampled with numpy), ``model``, ``language`` (default "en"; "auto" detects
it), ``prompt`` (earlier text to condition on), ``response_format`` ("json"
-> ``{"text"}``, "text", or "verbose_json" with one segment per 30 s window),
``temperature`` (default 0: greedy). Audio longer than the model's window is
split into windows transcribed as one batch. Served only by speech models
(Whisper); others answer 400.
"""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from vllite_core.audio import AudioDecodeError
from vllite_core.entrypoints import transcription as tr
from vllite_core.entrypoints.openai.errors import APIError, bad_request
from vllite_core.entrypoints.openai.serving_common import (
    ServerState,
    final_outputs,
    new_id,
    server_state,
    until_disconnect,
)
from vllite_core.sampling_params import SamplingParams

MAX_UPLOAD_BYTES = 25 << 20  # OpenAI's limit for audio uploads
FORMATS = ("json", "text", "verbose_json")
FIELDS = {"file", "model", "language", "prompt", "response_format", "temperature", "timestamp_granularities[]",
          "stream"}

router = APIRouter()


def _field(form: Any, name: str) -> str | None:
    v = form.get(name)
    if v is None:
        return None
    if not isinstance(v, str):
        raise bad_request(f"{name} must be a text field", name)
    return v


@router.post("/v1/audio/transcriptions")
async def create_transcription(request: Request) -> Response:
    return await _transcribe(server_state(request), request)


async def _transcribe(state: ServerState, request: Request) -> Response:
    engine = state.engine
    model_cls = engine.engine.model_cls
    try:
        tr.check_transcription_model(engine.engine)
    except ValueError as e:
        raise bad_request(str(e), "model", "model_not_supported") from None
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_UPLOAD_BYTES:
        raise APIError(413, f"upload of {declared} bytes is over the {MAX_UPLOAD_BYTES}-byte limit",
                       code="body_too_large")
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise bad_request("send the audio as multipart/form-data with a 'file' field", "file")
    try:
        form = await request.form(max_files=1, max_fields=len(FIELDS) + 4)
    except Exception as e:  # malformed multipart
        raise bad_request(f"malformed multipart body: {e}", "file") from None
    try:
        unknown = sorted(set(form.keys()) - FIELDS)
        if unknown:
            raise bad_request(f"unrecognized request argument: {unknown[0]}", unknown[0], "unknown_parameter")
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise bad_request("the 'file' field (the audio upload) is missing", "file")
        data = await upload.read(MAX_UPLOAD_BYTES + 1)
    finally:
        await form.close()
    if len(data) > MAX_UPLOAD_BYTES:
        raise APIError(413, f"upload is over the {MAX_UPLOAD_BYTES}-byte limit", code="body_too_large")
    state.check_model(_field(form, "model"))
    fmt = _field(form, "response_format") or "json"
    if fmt not in FORMATS:
        raise bad_request(f"response_format must be one of {', '.join(FORMATS)}, got {fmt!r}", "response_format")
    if (_field(form, "stream") or "false").lower() not in ("false", "0"):
        raise bad_request("streaming transcriptions are not supported", "stream")
    language = _field(form, "language") or "en"
    prompt = _field(form, "prompt")
    temperature = 0.0
    if _field(form, "temperature") is not None:
        try:
            temperature = float(_field(form, "temperature"))  # type: ignore[arg-type]
        except ValueError:
            raise bad_request("temperature must be a number", "temperature") from None
    try:
        samples, sr = await engine.run_prep(tr.as_audio, data)  # decoding is CPU work: off the event loop
    except AudioDecodeError as e:
        raise bad_request(f"file: {e}", "file", "invalid_audio") from None
    if samples.size == 0:
        raise bad_request("file: the audio is empty", "file", "invalid_audio")

    ctx = engine.input_context
    window_s = float(model_cls.max_audio_seconds(ctx))
    base = new_id("trsc")
    if language == "auto":
        det = tr.detection_request(model_cls, ctx, samples, sr, window_s)
        language = None
        if det is not None:
            out, = await until_disconnect(request, final_outputs(engine, [
                await engine.add_request_async(det[0], det[1], f"{base}-lang")]))
            language = det[2][out.outputs[0].token_ids[0]]
    prompts = tr.window_prompts(samples, sr, window_s, language, "transcribe", prompt, False)
    params = SamplingParams(temperature=temperature, max_tokens=None)
    streams = []
    try:
        for i, p in enumerate(prompts):
            streams.append(await engine.add_request_async(p, params, f"{base}-{i}"))
    except BaseException:
        for s in streams:
            engine.abort(s.request_id)
        raise
    outputs = await until_disconnect(request, final_outputs(engine, streams))
    text = tr.join_text(outputs)
    if fmt == "text":
        return PlainTextResponse(text)
    if fmt == "json":
        return JSONResponse({"text": text})
    segments = []
    for i, o in enumerate(outputs):
        start = i * window_s
        segments.append({"id": i, "start": start, "end": min(start + window_s, len(samples) / sr),
                         "text": o.outputs[0].text.strip(), "tokens": o.outputs[0].token_ids,
                         "temperature": temperature})
    return JSONResponse({"task": "transcribe", "language": language, "duration": len(samples) / sr, "text": text,
                         "segments": segments})
