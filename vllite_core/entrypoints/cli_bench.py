"""`vllite bench {throughput,latency,serve}`: vLLM-style benchmarks with JSON, tables and plots.

throughput  N requests (random token ids, or --dataset FILE) submitted at once to an
            in-process engine: requests/s, output tok/s, total tok/s, and where each
            step's time went (scheduler + input preparation + output processing vs the model).
latency     one batch (or a sweep of batch sizes) of fixed-length requests: end-to-end
            percentiles, time per output token, TTFT; --plot draws throughput vs batch size.
serve       a client for a running OpenAI-compatible server (/v1/completions, streaming) at a
            Poisson request rate and/or a maximum concurrency: TTFT, TPOT, ITL percentiles.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from typing import Any

from vllite_core.entrypoints.engine_args_cli import add_engine_args, engine_args_from_namespace


def add_bench_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="benchmarks: throughput, latency, serve")
    bsub = p.add_subparsers(dest="bench_command", metavar="BENCH", required=True)

    t = bsub.add_parser("throughput", help="offline throughput of N requests submitted at once")
    _workload_args(t, num_prompts=64)
    t.add_argument("--repeats", type=int, default=1, help="measured runs (the best is reported)")
    t.add_argument("--no-warmup", dest="warmup", action="store_false")
    t.add_argument("--keep-tokens", type=int, default=0, help="save the first K output ids of each request")
    _output_args(t)
    add_engine_args(t)
    t.set_defaults(func=run_throughput)

    lat = bsub.add_parser("latency", help="latency of one batch of requests (or a sweep of batch sizes)")
    lat.add_argument("--batch-size", type=int, nargs="+", default=[1], help="one or more batch sizes")
    lat.add_argument("--input-len", type=int, default=128)
    lat.add_argument("--output-len", type=int, default=128)
    lat.add_argument("--num-iters", type=int, default=3)
    lat.add_argument("--num-iters-warmup", type=int, default=1)
    lat.add_argument("--workload-seed", type=int, default=0, help="seed of the random token ids")
    _output_args(lat, plot=True)
    add_engine_args(lat)
    lat.set_defaults(func=run_latency)

    s = bsub.add_parser("serve", help="drive a running OpenAI-compatible server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000")
    s.add_argument("--served-model-name", dest="served_model", default=None,
                   help="model name to send (default: the first of /v1/models)")
    s.add_argument("--tokenizer-vocab-size", type=int, default=None,
                   help="vocabulary size bound for random ids (default: SmolLM2's 49152)")
    _workload_args(s, num_prompts=64)
    s.add_argument("--request-rate", type=float, nargs="+", default=[float("inf")],
                   help="requests/s (Poisson arrivals); inf = all at once; several values sweep")
    s.add_argument("--max-concurrency", type=int, nargs="+", default=[0],
                   help="most requests in flight (0 = unlimited); several values sweep")
    s.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps (1 = Poisson)")
    s.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    s.add_argument("--api-key", default=None)
    s.add_argument("--timeout", type=float, default=600.0)
    s.add_argument("--no-progress", dest="progress", action="store_false")
    _output_args(s, plot=True)
    s.set_defaults(func=run_serve)


def _workload_args(p: argparse.ArgumentParser, num_prompts: int) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=num_prompts)
    g.add_argument("--input-len", type=int, default=128)
    g.add_argument("--output-len", type=int, default=128)
    g.add_argument("--dataset", default=None,
                   help="JSONL or JSON list of {prompt | prompt_token_ids[, output_len]} (default: random ids)")
    g.add_argument("--workload-seed", type=int, default=0, help="seed of the random token ids")


def _output_args(p: argparse.ArgumentParser, plot: bool = False) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--output-json", default=None, help="write the result here")
    g.add_argument("--quiet", action="store_true", help="no table, only the JSON path")
    if plot:
        g.add_argument("--plot", default=None, help="PNG of output throughput vs the swept parameter")


def _requests(ns: argparse.Namespace, vocab: int | None, tokenizer: Any = None) -> list[Any]:
    from vllite_core.benchmarks.datasets import load_dataset, random_requests

    if ns.dataset:
        return load_dataset(ns.dataset, ns.num_prompts, ns.output_len, tokenizer)
    return random_requests(ns.num_prompts, ns.input_len, ns.output_len, ns.workload_seed, vocab)


def _emit(ns: argparse.Namespace, result: dict[str, Any], tables: list[str]) -> None:
    from vllite_core.benchmarks.report import save_json

    if ns.output_json:
        save_json(ns.output_json, result)
    if not ns.quiet:
        for t in tables:
            print(t)
            print()
    if ns.output_json:
        print(f"results: {ns.output_json}")
    elif ns.quiet:
        print(json.dumps(result, default=str))


def _profile_table(report: dict[str, Any]) -> str:
    from vllite_core.benchmarks.report import format_table
    from vllite_core.benchmarks.step_profile import OVERHEAD_HEADER, overhead_rows

    return format_table(overhead_rows({k: v for k, v in report.items() if isinstance(v, dict)}), OVERHEAD_HEADER,
                        "step time (ms per step); overhead = schedule + prepare + output")


def run_throughput(ns: argparse.Namespace) -> int:
    from vllite_core.benchmarks.offline import build_engine, throughput, vocab_size
    from vllite_core.benchmarks.report import format_table

    engine = build_engine(engine_args_from_namespace(ns))
    reqs = _requests(ns, vocab_size(engine), engine.tokenizer)
    res = throughput(engine, reqs, repeats=ns.repeats, warmup=ns.warmup, keep_tokens=ns.keep_tokens)
    rows = [["requests/s", res["requests_per_s"]], ["output tok/s", res["output_tokens_per_s"]],
            ["total tok/s", res["total_tokens_per_s"]], ["elapsed s", res["elapsed_s"]],
            ["requests", res["num_requests"]], ["prompt tokens", res["prompt_tokens"]],
            ["output tokens", res["output_tokens"]], ["TTFT p50 s", res["ttft_s"].get("p50")],
            ["TPOT p50 ms", 1e3 * res["tpot_s"].get("p50", float("nan"))],
            ["startup s", res["engine"]["startup_s"]]]
    tables = [format_table(rows, ["metric", "value"], f"throughput ({res['engine']['dtype']}, "
                                                      f"{res['workload']['num_requests']} requests)")]
    if "step_profile" in res:
        tables.append(_profile_table(res["step_profile"]))
    _emit(ns, res, tables)
    return 0


def run_latency(ns: argparse.Namespace) -> int:
    from vllite_core.benchmarks.offline import build_engine, engine_facts, latency
    from vllite_core.benchmarks.report import format_table, machine_facts, plot_xy

    engine = build_engine(engine_args_from_namespace(ns))
    results = [latency(engine, b, ns.input_len, ns.output_len, ns.num_iters, ns.num_iters_warmup, ns.workload_seed)
               for b in ns.batch_size]
    res = {"bench": "latency", "engine": engine_facts(engine), "machine": machine_facts(), "results": results}
    rows = [[r["batch_size"], r["e2e_s"]["p50"], r["e2e_s"]["p90"], r["e2e_s"]["p99"], r["ms_per_output_token"],
             r["ttft_ms"], r["decode_ms_per_token"], r["output_tokens_per_s"]] for r in results]
    tables = [format_table(rows, ["batch", "e2e p50 s", "p90 s", "p99 s", "ms/out tok", "TTFT ms", "decode ms/tok",
                                  "out tok/s"], f"latency ({ns.input_len} in, {ns.output_len} out)")]
    for r in results:
        if "step_profile" in r:
            tables.append(f"batch {r['batch_size']}:\n" + _profile_table(r["step_profile"]))
    if ns.plot:
        res["plot"] = plot_xy(ns.plot, [r["batch_size"] for r in results],
                              {"vllite": [r["output_tokens_per_s"] for r in results]}, "batch size",
                              "output tokens/s", f"vllite, {ns.input_len} in / {ns.output_len} out", logx=True)
    _emit(ns, res, tables)
    return 0


def run_serve(ns: argparse.Namespace) -> int:
    from vllite_core.benchmarks.report import format_table, plot_xy
    from vllite_core.benchmarks.serve import run_serve as serve

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    reqs = _requests(ns, ns.tokenizer_vocab_size)
    results = []
    for conc in ns.max_concurrency:
        for rate in ns.request_rate:
            r = asyncio.run(serve(ns.base_url, reqs, rate, conc or None, ns.served_model, ns.ignore_eos,
                                  ns.workload_seed, ns.burstiness, ns.progress, ns.timeout, ns.api_key))
            results.append(r)
    res = {"bench": "serve", "results": results}
    rows = []
    for r in results:
        rows.append([r["max_concurrency"] or "-", r["request_rate"], r["completed"], r["failed"],
                     r["requests_per_s"], r["output_tokens_per_s"],
                     r["ttft_ms"].get("p50"), r["ttft_ms"].get("p90"), r["ttft_ms"].get("p99"),
                     r["tpot_ms"].get("p50"), r["tpot_ms"].get("p90"), r["tpot_ms"].get("p99"),
                     r["itl_ms"].get("p50"), r["itl_ms"].get("p90"), r["itl_ms"].get("p99")])
    header = ["conc", "rate", "ok", "fail", "req/s", "out tok/s", "TTFT p50", "p90", "p99", "TPOT p50", "p90", "p99",
              "ITL p50", "p90", "p99"]
    tables = [format_table(rows, header, f"serve {ns.base_url} (times in ms)")]
    for r in results:
        if r["errors"]:
            tables.append("errors: " + "; ".join(r["errors"]))
    if ns.plot and results:
        if len(ns.max_concurrency) > 1:
            x, label = [r["max_concurrency"] or 0 for r in results], "max concurrency (0 = unlimited)"
        else:
            x, label = [r["request_rate"] if r["request_rate"] != "inf" else 0 for r in results], \
                "request rate (req/s; 0 = all at once)"
        res["plot"] = plot_xy(ns.plot, x, {"output tok/s": [r["output_tokens_per_s"] for r in results]}, label,
                              "output tokens/s", f"serve: {ns.base_url}")
    _emit(ns, res, tables)
    return 0 if all(r["completed"] for r in results) else 1


if __name__ == "__main__":
    from vllite_core.entrypoints.cli import main

    sys.exit(main(["bench", *sys.argv[1:]]))
