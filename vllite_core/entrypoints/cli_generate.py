"""`vllite generate` and `vllite chat`."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from vllite_core.entrypoints.engine_args_cli import add_engine_args, engine_args_from_namespace
from vllite_core.errors import InvalidRequestError


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def _sampling_params(ns: argparse.Namespace) -> Any:
    from vllite_core.sampling_params import SamplingParams

    return SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
                          min_p=ns.min_p, seed=ns.sampling_seed, stop=ns.stop, ignore_eos=ns.ignore_eos)


def add_generate_parser(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate completions for prompts (offline)")
    p.add_argument("prompts", nargs="*", help="prompt strings")
    p.add_argument("--input", help="JSONL file: one {\"prompt\": ...} or {\"prompt_token_ids\": [...]} per line")
    p.add_argument("--output", help="write results as JSONL here (default: print)")
    p.add_argument("--chat-template", action="store_true", help="wrap each prompt as a user chat message")
    p.add_argument("--image", action="append", default=None, metavar="PATH",
                   help="image file given to every prompt (repeatable; multimodal models): the prompt holds the "
                        "model's placeholder (<image>) per image, or --chat-template puts the images in the message")
    _add_sampling_args(p)
    add_engine_args(p)
    p.set_defaults(func=run_generate)


def add_chat_parser(sub: Any) -> None:
    p = sub.add_parser("chat", help="interactive chat in the terminal, streaming tokens")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--image", action="append", default=None, metavar="PATH",
                   help="image for the first message (repeatable; multimodal models); '/image PATH' in the chat "
                        "attaches one to the next message")
    _add_sampling_args(p)
    add_engine_args(p)
    p.set_defaults(func=run_chat, max_tokens=512)


def _read_prompts(ns: argparse.Namespace) -> list[Any]:
    prompts: list[Any] = list(ns.prompts)
    if ns.input:
        with open(ns.input) as f:
            for n, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SystemExit(f"{ns.input}:{n}: not JSON: {e}")
                prompts.append(obj if isinstance(obj, dict) else str(obj))
    if not prompts:
        raise SystemExit("vllite generate: give prompts as arguments or --input FILE")
    return prompts


def run_generate(ns: argparse.Namespace) -> int:
    from vllite_core.engine.llm_engine import LLMEngine
    from vllite_core.entrypoints.llm import LLM

    prompts = _read_prompts(ns)
    params = _sampling_params(ns)
    llm = LLM.from_engine(LLMEngine.from_engine_args(engine_args_from_namespace(ns)))
    shown = [p if isinstance(p, str) else p.get("prompt") for p in prompts]
    images = _load_images(ns.image or [])
    if ns.chat_template and images:
        parts = [{"type": "image_pil", "image_pil": im} for im in images]
        outputs = llm.chat([[{"role": "user", "content": parts + [{"type": "text", "text": text}]}]
                            for text in shown], params)
    else:
        if ns.chat_template:
            prompts = [{"prompt": llm.apply_chat_template([{"role": "user", "content": text}])} for text in shown]
        if images:
            prompts = [{**(p if isinstance(p, dict) else {"prompt": p}), "multi_modal_data": {"image": images}}
                       for p in prompts]
        outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    sink = open(ns.output, "w") if ns.output else None
    for text, out in zip(shown, outputs):
        comp = out.outputs[0]
        if sink:
            sink.write(json.dumps({"prompt": text, "text": comp.text, "token_ids": comp.token_ids,
                                   "finish_reason": comp.finish_reason}) + "\n")
        else:
            print(f"--- prompt: {text!r}" if text is not None else f"--- request {out.request_id}")
            print(comp.text)
            m = out.metrics
            if m and m.time_to_first_token is not None:
                print(f"[{len(comp.token_ids)} tokens, finish={comp.finish_reason}, "
                      f"ttft={m.time_to_first_token * 1000:.0f} ms, decode={m.decode_time or 0:.2f} s]",
                      file=sys.stderr)
    if sink:
        sink.close()
        print(f"wrote {len(outputs)} results to {ns.output}", file=sys.stderr)
    return 0


def _load_images(paths: list[str]) -> list[Any]:
    from PIL import Image, UnidentifiedImageError

    images = []
    for path in paths:
        try:
            with Image.open(path) as im:
                images.append(im.convert("RGB"))
        except (OSError, UnidentifiedImageError) as e:
            raise SystemExit(f"vllite generate: --image {path}: {e}")
    return images


def run_chat(ns: argparse.Namespace) -> int:
    from vllite_core.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(engine_args_from_namespace(ns))
    params = _sampling_params(ns)
    from vllite_core.multimodal.chat import chat_engine_prompt

    history: list[dict[str, Any]] = []
    if ns.system:
        history.append({"role": "system", "content": ns.system})
    pending = _load_images(ns.image or [])  # images for the next user message
    print("vllite chat: type a message, '/image PATH' to attach an image, Ctrl-D to quit.", file=sys.stderr)
    n = 0
    while True:
        try:
            user = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not user.strip():
            continue
        if user.startswith("/image "):
            try:
                pending += _load_images([user[len("/image "):].strip()])
            except SystemExit as e:
                print(e, file=sys.stderr)
            continue
        content: Any = user
        if pending:
            content = [{"type": "image_pil", "image_pil": im} for im in pending] + [{"type": "text", "text": user}]
        history.append({"role": "user", "content": content})
        try:
            prompt = chat_engine_prompt(engine, history, lambda msgs: engine.tokenizer.apply_chat_template(
                msgs, tokenize=False, add_generation_prompt=True))
            n += 1
            rid = engine.add_request(f"chat-{n}", prompt, params)
        except InvalidRequestError as e:
            print(f"error: {e}", file=sys.stderr)
            history.pop()
            continue
        pending = []
        reply = ""
        while engine.has_unfinished_requests():
            for out in engine.step(delta=True):
                if out.request_id == rid:
                    piece = out.outputs[0].text
                    reply += piece
                    print(piece, end="", flush=True)
        print()
        history.append({"role": "assistant", "content": reply})
