"""`vllite serve`: the OpenAI-compatible HTTP server on one engine."""
from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from typing import TYPE_CHECKING, Any, NoReturn

from vllite_core.engine.dp_layout import DEFAULT_RPC_PORT, DataParallelLayout, data_parallel_layout
from vllite_core.engine.restart import DEFAULT_MAX_RESTARTS, DEFAULT_WINDOW_S
from vllite_core.entrypoints.engine_args_cli import add_engine_args, engine_args_from_namespace

if TYPE_CHECKING:
    from vllite_core.engine.async_llm import AsyncLLM
    from vllite_core.entrypoints.openai.serving_lora import ServedLoRAs

API_KEY_ENV = "VLLITE_API_KEY"


def add_serve_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("model_tag", nargs="?", default=None, help="model (same as --model)")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    g.add_argument("--port", type=int, default=8000, help="port (0: pick a free one; the start-up line says which)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health, /version, /metrics and "
                   f"the OpenAPI docs (default: ${API_KEY_ENV})")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use for the model (default: the model path, or SmolLM2-135M-Instruct)")
    g.add_argument("--max-request-body-bytes", type=int, default=None, help="larger bodies get 413 (default 4 MiB)")
    g.add_argument("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    g.add_argument("--disable-access-log", action="store_true", help="no log line per HTTP request")
    g.add_argument("--allowed-origins", nargs="+", default=None,
                   help="CORS: origins web pages may call from (e.g. http://localhost:3000, or '*'); default: CORS off")
    g.add_argument("--allowed-methods", nargs="+", default=None, help="CORS methods (default: all)")
    g.add_argument("--allowed-headers", nargs="+", default=None, help="CORS request headers (default: all)")
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    g.add_argument("--allowed-hosts", nargs="+", default=None,
                   help="Host header values accepted (any port); default on a loopback bind: 127.0.0.1 localhost "
                   "::1 (DNS rebinding), otherwise any")
    g.add_argument("--max-waiting-requests", type=int, default=None,
                   help="with this many requests accepted but not started, new ones get 503 + Retry-After")
    g.add_argument("--max-logprob-entries-in-flight", type=int, default=4 << 20,
                   help="logprob entries (prompt_logprobs / echo and logprobs, times n and max_tokens) the requests "
                   "in flight may hold: a request over it gets 400 naming the field, one that does not fit now "
                   "503 + Retry-After; 0: no limit")
    g.add_argument("--engine-restart-queue-size", type=int, default=64,
                   help="while a dead engine core restarts, this many new requests wait for it (more: 503 + "
                   "Retry-After); 0: all get 503 at once")
    g.add_argument("--engine-restart-queue-timeout", type=float, default=60.0,
                   help="seconds a request waits for a restarting engine core before it gets 503 + Retry-After")
    g.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a generation request may take from arrival; then it is aborted (504, or an "
                   "error event in a stream); default: none")
    g.add_argument("--body-read-timeout", type=float, default=30.0, help="seconds to receive a request body (408)")
    g.add_argument("--timeout-keep-alive", type=int, default=5, help="seconds an idle keep-alive connection stays open")
    g.add_argument("--header-read-timeout", type=float, default=30.0,
                   help="seconds a connection has to send a complete request line and headers, else it is closed")
    g.add_argument("--shutdown-timeout", type=float, default=20.0,
                   help="on SIGTERM / Ctrl-C, seconds in-flight requests may finish before they are ended")
    g.add_argument("--disable-fastapi-docs", action="store_true", help="no /openapi.json and /docs")
    g.add_argument("--chat-template", default=None,
                   help="chat template for /v1/chat/completions and /v1/responses: a file path or the jinja "
                   "template itself (default: the tokenizer's)")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a request's own chat_template (a program run on this server, in the template "
                   "sandbox); default: such requests get 400")
    g.add_argument("--chat-template-timeout", type=float, default=5.0,
                   help="CPU seconds one chat template render may take before it is stopped (400 naming chat_template)")
    g.add_argument("--chat-template-max-output-chars", type=int, default=16 << 20,
                   help="characters a chat template may produce (more: 400 naming chat_template)")
    g.add_argument("--chat-template-memory-mb", type=int, default=512,
                   help="MiB a chat template render may allocate (more: 400 naming chat_template)")
    g.add_argument("--health-stall-timeout", type=float, default=30.0,
                   help="/health answers 503 when the engine core makes no step with requests in flight, or request "
                   "preparation makes no progress, for this many seconds (and at once for a stopped core)")
    g.add_argument("--reasoning-parser", default=None,
                   help="split reasoning out of the output into `reasoning` (deepseek_r1, qwen3, glm45, granite, "
                   "mistral, openai_gptoss; "
                   "`vllite plugins` lists plugins that add more)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="allow tool_choice 'auto': the model's tool calls are parsed with --tool-call-parser")
    g.add_argument("--tool-call-parser", default=None, help="tool-call parser for tool_choice 'auto' (hermes, "
                   "llama3_json, mistral, pythonic, qwen3_coder, glm45, deepseek_v3, deepseek_v31, granite, openai, "
                   "or a plugin's)")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters served as model names (needs --enable-lora): name=path, or JSON "
                   "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'")
    g.add_argument("--lora-allowed-root", default=None, metavar="DIR",
                   help="with VLLM_ALLOW_RUNTIME_LORA_UPDATING set: the only directory /v1/load_lora_adapter may "
                   "load adapters from (without it runtime loads are refused)")
    g.add_argument("--max-lora-adapter-bytes", type=int, default=1 << 30,
                   help="runtime adapter loads: the most bytes an adapter's files may hold together (default 1 GiB)")
    g.add_argument("--ssl-keyfile", default=None, help="serve HTTPS: the private key file (PEM) of --ssl-certfile")
    g.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate (PEM)")
    g.add_argument("--root-path", default="",
                   help="the path prefix a proxy serves this server under (e.g. /llm): routes answer with or "
                   "without it, and the OpenAPI docs name it")
    g.add_argument("--uds", default=None, metavar="PATH",
                   help="listen on this unix domain socket instead of --host/--port")
    g.add_argument("--enable-log-requests", action="store_true",
                   help="log each request as it is added (id, sampling params, adapter; its prompt at DEBUG)")
    g.add_argument("--max-log-len", type=int, default=None,
                   help="with --enable-log-requests: the most prompt characters / token ids a DEBUG line shows")
    g.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="export an OpenTelemetry span per request to this OTLP/HTTP receiver "
                   "(e.g. http://localhost:4318/v1/traces); needs opentelemetry-sdk")
    g.add_argument("--enable-server-load-tracking", action="store_true",
                   help="count the requests in flight on the generation and pooling routes; GET /load reports it")
    g.add_argument("--engine-restart-max", type=int, default=DEFAULT_MAX_RESTARTS,
                   help="a dead engine-core process is started again (its open requests fail with engine_dead, "
                   "/health answers 503 meanwhile) at most this many times within --engine-restart-window; "
                   "then the server exits non-zero (0: exit at the first death)")
    g.add_argument("--engine-restart-window", type=float, default=DEFAULT_WINDOW_S,
                   help="seconds over which --engine-restart-max counts restarts (each waits 1 s, doubling with "
                   "the restarts already made in the window, up to 30 s)")
    # what a --headless node may not be given (it restarts its own cores within the restart budget)
    api_server_options = [(a.dest, a.default, a.option_strings[0]) for a in g._group_actions
                          if a.dest not in ("engine_restart_max", "engine_restart_window")]
    _add_data_parallel_args(p)
    add_engine_args(p)
    p.set_defaults(func=run_serve, api_server_options=api_server_options)


def _add_data_parallel_args(p: argparse.ArgumentParser) -> None:
    d = p.add_argument_group("data parallel (docs/parallel.md)")
    d.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine cores in all (over every node), each a full copy of the model in its own process; "
                   "a request goes to the one with the fewest unfinished requests (needs "
                   "VLLITE_ENABLE_V1_MULTIPROCESSING=1, the default)")
    d.add_argument("--data-parallel-size-local", "-dpl", type=int, default=None,
                   help="engine cores on this node (default: the ranks from --data-parallel-start-rank on); fewer "
                   "than --data-parallel-size: the others run on --headless nodes")
    d.add_argument("--data-parallel-start-rank", "-dpr", type=int, default=0,
                   help="a --headless node's first data-parallel rank")
    d.add_argument("--data-parallel-address", "-dpa", default=None,
                   help="the head node's address: its API server listens there for the other nodes' engine cores, "
                   "which connect to it")
    d.add_argument("--data-parallel-rpc-port", "-dpp", type=int, default=DEFAULT_RPC_PORT,
                   help=f"the TCP port of --data-parallel-address (default {DEFAULT_RPC_PORT})")
    d.add_argument("--data-parallel-backend", "-dpb", choices=("mp", "ray"), default="mp",
                   help="who starts the ranks past --data-parallel-size-local: mp, a --headless node started on each "
                   "other node; ray, this API server, as Ray actors on the other nodes of a running Ray cluster "
                   "(RAY_ADDRESS, else auto; --data-parallel-address defaults to this node's IP there)")
    d.add_argument("--headless", action="store_true",
                   help="run this node's engine cores only, no API server: they connect to the head node's at "
                   "--data-parallel-address:--data-parallel-rpc-port (and start again when they exit, within "
                   "--engine-restart-max)")


def run_serve(ns: argparse.Namespace) -> int:
    from vllite_core.engine.async_llm import AsyncLLM
    from vllite_core.engine.restart import RestartPolicy
    from vllite_core.entrypoints.openai.api_server import bind_socket, bind_unix_socket, default_model_name

    if ns.model_tag is not None:
        if ns.model is not None and ns.model != ns.model_tag:
            raise SystemExit("vllite serve: the model is given twice, differently")
        ns.model = ns.model_tag
    dp = _data_parallel(ns)
    for flag, least in (("max_waiting_requests", 1), ("request_timeout", 1e-3), ("body_read_timeout", 0),
                        ("header_read_timeout", 1e-3), ("chat_template_timeout", 1e-3),
                        ("chat_template_max_output_chars", 1), ("chat_template_memory_mb", 16),
                        ("health_stall_timeout", 1e-3), ("engine_restart_max", 0), ("engine_restart_window", 1e-3),
                        ("max_logprob_entries_in_flight", 0), ("engine_restart_queue_size", 0),
                        ("engine_restart_queue_timeout", 0),
                        ("shutdown_timeout", 0)):
        if getattr(ns, flag) is not None and getattr(ns, flag) < least:
            raise SystemExit(f"vllite serve: --{flag.replace('_', '-')} must be at least {least:g}")
    if dp.headless:
        from vllite_core.entrypoints.cli_headless import run_headless

        return run_headless(ns, dp, RestartPolicy(ns.engine_restart_max, ns.engine_restart_window))
    api_key = ns.api_key or os.environ.get(API_KEY_ENV) or None
    names = ns.served_model_name or [default_model_name(ns.model)]
    chat_template, reasoning_parser = _frontend_options(ns)
    if ns.enable_auto_tool_choice and not ns.tool_call_parser:
        raise SystemExit("vllite serve: --enable-auto-tool-choice needs --tool-call-parser")
    if ns.lora_modules and not ns.enable_lora:
        raise SystemExit("vllite serve: --lora-modules needs --enable-lora")
    from vllite_core.entrypoints.openai.serving_lora import ServedLoRAs, parse_lora_module, runtime_updates_allowed

    try:
        lora_modules = [parse_lora_module(m) for m in ns.lora_modules or []]
    except ValueError as e:
        raise SystemExit(f"vllite serve: {e}") from None
    _deployment_options(ns)
    # a busy port fails now, not after loading the model
    sock = bind_unix_socket(ns.uds) if ns.uds else bind_socket(ns.host, ns.port)
    try:
        restart = RestartPolicy(ns.engine_restart_max, ns.engine_restart_window)
        if dp.backend == "ray" and dp.spans_nodes:
            from vllite_core.engine.dp_ray import front_end_address

            dp = front_end_address(dp)
        engine = AsyncLLM.from_engine_args(engine_args_from_namespace(ns), dp.size, restart=restart,
                                           dp=dp if dp.spans_nodes else None)
    except KeyboardInterrupt:
        sock.close()
        print("vllite: stopped while loading the model", flush=True)
        return 130
    except BaseException as e:
        sock.close()
        if isinstance(e, SystemExit):
            raise
        # the engine core's own error text, whether it failed here or in its process
        raise SystemExit(f"vllite serve: the engine failed to start: {type(e).__name__}: {e}") from None
    print(describe_layout(engine.layout()), flush=True)
    print(describe_memory(engine.core.info.memory, len(engine.engine_stats())), flush=True)
    parallel = engine.parallel_layout()
    if parallel:
        from vllite_core.distributed.layout import format_layout

        print("\n".join(format_layout(parallel)), flush=True)
    loras = None
    if ns.enable_lora:
        try:
            loras = ServedLoRAs(engine, names[0], lora_modules, ns.lora_allowed_root, runtime_updates_allowed())
            loras.max_adapter_bytes = ns.max_lora_adapter_bytes
        except ValueError as e:  # a bad adapter: refuse to start, naming it
            engine.close()
            sock.close()
            raise SystemExit(f"vllite serve: --lora-modules: {e}") from None
    try:
        _serve_until_stopped(engine, names, sock, api_key, ns, chat_template, reasoning_parser, loras)
    except SystemExit as e:  # the engine died, or a second signal: the message and status Python would give
        _exit_at_once(e.code)
    _exit_at_once(0)


def _exit_at_once(code: int | str | None) -> NoReturn:
    """The server has stopped and closed its engine: end the process without the interpreter's teardown of
    torch and every module, 2-3 s of every stop spent after the work is done."""
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def _serve_until_stopped(engine: AsyncLLM, names: list[str], sock: socket.socket, api_key: str | None,
                         ns: argparse.Namespace, chat_template: str | None, reasoning_parser: str | None,
                         loras: ServedLoRAs | None) -> None:
    from vllite_core.entrypoints.openai.api_server import serve
    from vllite_core.entrypoints.openai.serving_common import DEFAULT_MAX_BODY_BYTES
    from vllite_core.entrypoints.openai.template_sandbox import TemplateLimits

    serve(engine, names, sock, api_key, ns.max_request_body_bytes or DEFAULT_MAX_BODY_BYTES,
          ns.uvicorn_log_level, not ns.disable_access_log, shutdown_timeout=ns.shutdown_timeout,
          timeout_keep_alive=ns.timeout_keep_alive, header_read_timeout=ns.header_read_timeout,
          allowed_origins=ns.allowed_origins,
          allowed_methods=ns.allowed_methods, allowed_headers=ns.allowed_headers,
          allow_credentials=ns.allow_credentials, allowed_hosts=ns.allowed_hosts,
          max_waiting_requests=ns.max_waiting_requests, request_timeout=ns.request_timeout,
          max_logprob_entries_in_flight=ns.max_logprob_entries_in_flight,
          restart_queue_size=ns.engine_restart_queue_size, restart_queue_timeout=ns.engine_restart_queue_timeout,
          body_read_timeout=ns.body_read_timeout or None, enable_docs=not ns.disable_fastapi_docs,
          chat_template=chat_template, reasoning_parser=reasoning_parser,
          enable_auto_tool_choice=ns.enable_auto_tool_choice, tool_call_parser=ns.tool_call_parser, loras=loras,
          trust_request_chat_template=ns.trust_request_chat_template,
          template_limits=TemplateLimits(ns.chat_template_timeout, ns.chat_template_max_output_chars,
                                         ns.chat_template_memory_mb << 20),
          health_stall_s=ns.health_stall_timeout, ssl_keyfile=ns.ssl_keyfile, ssl_certfile=ns.ssl_certfile,
          root_path=ns.root_path, enable_log_requests=ns.enable_log_requests, max_log_len=ns.max_log_len,
          otlp_traces_endpoint=ns.otlp_traces_endpoint, enable_server_load_tracking=ns.enable_server_load_tracking)


def _data_parallel(ns: argparse.Namespace) -> DataParallelLayout:
    """The data-parallel flags, checked (a combination that cannot work exits naming the flag); a
    --headless node given an API server's option exits naming that option."""
    from vllite_core.errors import ConfigError

    try:
        dp = data_parallel_layout(ns.data_parallel_size, ns.data_parallel_size_local, ns.data_parallel_start_rank,
                                  ns.data_parallel_address, ns.data_parallel_rpc_port, ns.headless,
                                  ns.data_parallel_backend)
    except ConfigError as e:
        raise SystemExit(f"vllite serve: {e}") from None
    if dp.headless:
        given = [flag for dest, default, flag in ns.api_server_options if getattr(ns, dest) != default]
        if given:
            raise SystemExit(f"vllite serve: --headless runs no API server: {', '.join(given)} cannot be given")
    return dp


def _deployment_options(ns: argparse.Namespace) -> None:
    """TLS files, the root path and tracing checked before the model loads."""
    if (ns.ssl_keyfile is None) != (ns.ssl_certfile is None):
        raise SystemExit("vllite serve: give --ssl-keyfile and --ssl-certfile together")
    for flag in ("ssl_keyfile", "ssl_certfile"):
        path = getattr(ns, flag)
        if path is not None and not os.path.isfile(path):
            raise SystemExit(f"vllite serve: --{flag.replace('_', '-')} {path}: no such file")
    if ns.root_path and (not ns.root_path.startswith("/") or ns.root_path.endswith("/")):
        raise SystemExit(f"vllite serve: --root-path {ns.root_path!r} must start with '/' and not end with one")
    if ns.max_log_len is not None and ns.max_log_len < 0:
        raise SystemExit("vllite serve: --max-log-len must be at least 0")
    if ns.otlp_traces_endpoint is not None:
        from vllite_core.entrypoints.openai.tracing import TracingUnavailableError, check_available

        try:
            check_available(ns.otlp_traces_endpoint)
        except TracingUnavailableError as e:
            raise SystemExit(f"vllite serve: {e}") from None


def describe_layout(layout: dict[str, Any]) -> str:
    """One start-up line: which process serves HTTP and which run the engine cores (by DP rank)."""
    cores = layout["engine_cores"]
    if cores and cores[0].get("in_process"):
        return f"vllite: process layout: API server and engine core in pid {layout['api_pid']} (in-process engine)"
    ranks = ", ".join(f"DP rank {c['dp_rank']} pid {c['pid']}" + (f" on {c['node']}" if c.get("remote") else "")
                      for c in cores)
    return (f"vllite: process layout: API server pid {layout['api_pid']}; {len(cores)} engine core "
            f"process{'es' if len(cores) != 1 else ''} ({ranks})")


def describe_memory(mem: Any, num_cores: int) -> str:
    """One start-up line: what each engine core will really hold (its KV cache counted in full)."""
    gib = 2 ** 30
    each = " each" if num_cores > 1 else ""
    if not mem.kv_in_host_memory:
        return (f"vllite: memory{each}: weights {mem.weights_bytes / gib:.2f} GiB, KV cache "
                f"{mem.kv_cache_bytes / gib:.2f} GiB in device memory; the engine core holds "
                f"{mem.resident_bytes / gib:.2f} GiB of host memory")
    how = "committed at start (--commit-kv-cache)" if mem.kv_committed else \
        "committed as blocks are first used; --commit-kv-cache commits it at start"
    return (f"vllite: memory{each}: weights {mem.weights_bytes / gib:.2f} GiB + KV cache "
            f"{mem.kv_cache_bytes / gib:.2f} GiB ({how}): the engine core holds {mem.resident_bytes / gib:.2f} GiB "
            f"now and will hold up to {mem.planned_bytes / gib:.2f} GiB")


def _frontend_options(ns: argparse.Namespace) -> tuple[str | None, str | None]:
    """--chat-template's text and --reasoning-parser's name, checked before the model loads."""
    from vllite_core.entrypoints.chat_template import load_chat_template
    from vllite_core.reasoning import reasoning_parser_names

    try:
        template = load_chat_template(ns.chat_template)
    except (OSError, ValueError) as e:
        raise SystemExit(f"vllite serve: {e}")
    if ns.reasoning_parser is not None and ns.reasoning_parser not in reasoning_parser_names():
        raise SystemExit(f"vllite serve: unknown --reasoning-parser {ns.reasoning_parser!r}; known: "
                         f"{', '.join(reasoning_parser_names())}")
    return template, ns.reasoning_parser
