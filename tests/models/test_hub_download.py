"""Models by Hub repo id, through the real huggingface_hub download code against a local fake Hub
(tests/fake_hub.py on 127.0.0.1, pointed to by HF_ENDPOINT).

huggingface_hub reads HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE when it is imported, and this suite
runs with HF_HUB_OFFLINE=1, so every download runs in a subprocess with its own environment: the
endpoint, a temporary HF_HOME, and offline mode switched off (or on, for the cache-only runs).
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fake_hub import FakeHub, FakeRepo
from hf_reference import hf_greedy
from test_model_gguf import _random_hf, _write_gguf

LLAMA, GGUF_REPO, GATED, FLAKY = "org/tiny-llama", "org/tiny-GGUF", "org/gated-llama", "org/flaky-llama"
COMMIT = "1" * 40
TOKEN = "hf_fake_token_for_tests"
PROMPT = [1, 17, 42, 99, 7, 250]


@pytest.fixture(scope="module")
def hub(tmp_path_factory, tiny_path):
    from transformers import LlamaConfig

    gguf_dir = tmp_path_factory.mktemp("gguf-repo")
    hf = _random_hf(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    for name in ("tiny-Q8_0.gguf", "tiny-Q4_K_M.gguf", "tiny-v2-Q4_K_M.gguf"):
        _write_gguf(gguf_dir / name, "llama", hf, {})
    (gguf_dir / "README.md").write_text("three GGUF files\n")
    repos = {LLAMA: FakeRepo(Path(tiny_path), commit=COMMIT, branches=("main", "v1")),
             GGUF_REPO: FakeRepo(gguf_dir, commit="2" * 40),
             GATED: FakeRepo(Path(tiny_path), commit="3" * 40, token=TOKEN)}
    with FakeHub(repos) as h:
        yield h


def run_py(code: str, hub: FakeHub, home: Path, offline: bool = False) -> tuple[dict, str]:
    """Run ``code`` in a fresh interpreter against the fake hub; it prints one JSON line last."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(home), HF_HUB_OFFLINE="1" if offline else "0",
               TRANSFORMERS_OFFLINE="1" if offline else "0", HF_HUB_DISABLE_TELEMETRY="1",
               NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost", VLLITE_CACHE_DIR=str(home / "vllite"))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


GENERATE = f"""
import json
from vllite_core.entrypoints.llm import LLM
from vllite_core.sampling_params import SamplingParams
llm = LLM(model={LLAMA!r}, revision="v1", dtype="float32", num_kv_blocks=32)
out = llm.generate([{{"prompt_token_ids": {PROMPT}}}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
print(json.dumps({{"tokens": out[0].outputs[0].token_ids, "path": llm.llm_engine.model_info.source.path}}))
"""


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("hf-home")


def test_repo_id_downloads_and_generates_like_hf(hub, home, tiny_path):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    want = hf_greedy(ref, PROMPT, 8)
    got, err = run_py(GENERATE, hub, home)
    assert got["tokens"] == want
    snapshot = home / "hub" / "models--org--tiny-llama" / "snapshots" / COMMIT
    assert Path(got["path"]) == snapshot.resolve()
    assert "Fetching" in err  # the hub library's progress bar
    fetched = {r[1].rsplit("/", 1)[-1] for r in hub.requests if r[0] == "GET" and "/tiny-llama/resolve/" in r[1]}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= fetched
    assert (snapshot / "model.safetensors").read_bytes() == (Path(tiny_path) / "model.safetensors").read_bytes()


ERRORS = f"""
import json, os
from model_registry.source import resolve_model_source
out = {{}}
def attempt(key, *args, **kw):
    try:
        s = resolve_model_source(*args, **kw)
        out[key] = {{"ok": True, "kind": s.kind, "path": s.path, "gguf": s.gguf_file}}
    except Exception as e:
        out[key] = {{"ok": False, "type": type(e).__name__, "msg": str(e)}}
attempt("unknown_repo", "org/no-such-model")
attempt("unknown_revision", {LLAMA!r}, revision="no-such-branch")
attempt("gated_no_token", {GATED!r})
os.environ["HF_TOKEN"] = "hf_wrong"
attempt("gated_wrong_token", {GATED!r})
os.environ["HF_TOKEN"] = {TOKEN!r}
attempt("gated_token", {GATED!r})
del os.environ["HF_TOKEN"]
attempt("quant", "{GGUF_REPO}:q8_0")
attempt("quant_none", "{GGUF_REPO}:Q5_K_M")
attempt("quant_several", "{GGUF_REPO}:Q4_K_M")
attempt("gguf_no_quant", {GGUF_REPO!r})
attempt("gguf_file", {GGUF_REPO!r}, gguf_file="tiny-v2-Q4_K_M.gguf")
attempt("gguf_file_missing", {GGUF_REPO!r}, gguf_file="nope.gguf")
print(json.dumps(out))
"""


def test_bad_input_and_gguf_quant(hub, home, tiny_path):
    got, _ = run_py(ERRORS, hub, home)
    assert got["unknown_repo"]["type"] == "HubRepoNotFoundError" and "org/no-such-model" in got["unknown_repo"]["msg"]
    assert got["unknown_revision"]["type"] == "HubRevisionNotFoundError"
    assert "no-such-branch" in got["unknown_revision"]["msg"]
    for key in ("gated_no_token", "gated_wrong_token"):
        assert got[key]["type"] == "HubAccessError" and "HF_TOKEN" in got[key]["msg"], got[key]
        assert "HTTP 401" in got[key]["msg"]
    assert got["gated_token"]["ok"] and got["gated_token"]["kind"] == "hf"
    gated = Path(got["gated_token"]["path"])
    assert (gated / "model.safetensors").read_bytes() == (Path(tiny_path) / "model.safetensors").read_bytes()
    assert got["quant"]["ok"] and got["quant"]["kind"] == "gguf"
    assert os.path.basename(got["quant"]["gguf"]) == "tiny-Q8_0.gguf"
    served = hub.repos[GGUF_REPO].files["tiny-Q8_0.gguf"]
    assert hashlib.sha256(Path(got["quant"]["gguf"]).read_bytes()).digest() == hashlib.sha256(served).digest()
    assert got["quant_none"]["type"] == "HubFileNotFoundError" and "tiny-Q8_0.gguf" in got["quant_none"]["msg"]
    assert got["quant_several"]["type"] == "HubFileNotFoundError" and "several" in got["quant_several"]["msg"]
    assert got["gguf_no_quant"]["type"] == "HubFileNotFoundError" and ":QUANT" in got["gguf_no_quant"]["msg"]
    assert os.path.basename(got["gguf_file"]["gguf"]) == "tiny-v2-Q4_K_M.gguf"
    assert got["gguf_file_missing"]["type"] == "HubFileNotFoundError"
    # Only the GGUF files asked for were fetched: never the other quant.
    assert not [r for r in hub.file_requests("tiny-Q4_K_M.gguf") if r[0] == "GET"]
    assert not hub.file_requests("README.md")


OFFLINE = f"""
import json
from model_registry.source import resolve_model_source
out = {{}}
for key, model, rev in (("never_cached", "org/never-downloaded", None), ("quant", "{GGUF_REPO}:Q8_0", None),
                        ("quant_not_cached", "{GGUF_REPO}:Q4_K_M", None),
                        ("revision_not_cached", "{GGUF_REPO}:Q8_0", "v9")):
    try:
        out[key] = {{"ok": True, "gguf": resolve_model_source(model, revision=rev).gguf_file}}
    except Exception as e:
        out[key] = {{"ok": False, "type": type(e).__name__, "msg": str(e)}}
print(json.dumps(out))
"""


def test_offline_uses_the_cache_or_says_what_is_missing(hub, tmp_path):
    home = tmp_path / "home"
    run_py(f"from model_registry.source import resolve_model_source as r; r('{GGUF_REPO}:Q8_0'); print('{{}}')",
           hub, home)
    before = len(hub.requests)
    got, _ = run_py(OFFLINE, hub, home, offline=True)
    assert len(hub.requests) == before
    assert got["never_cached"]["type"] == "ModelNotCachedError"
    assert "HF_HUB_OFFLINE" in got["never_cached"]["msg"] and "org/never-downloaded" in got["never_cached"]["msg"]
    assert got["quant"]["ok"] and got["quant"]["gguf"].endswith("tiny-Q8_0.gguf")
    assert got["quant_not_cached"]["type"] == "ModelNotCachedError"  # only Q8_0 is in the cache
    assert "Q4_K_M" in got["quant_not_cached"]["msg"] and "HF_HUB_OFFLINE" in got["quant_not_cached"]["msg"]
    assert got["revision_not_cached"]["type"] == "ModelNotCachedError" and "v9" in got["revision_not_cached"]["msg"]


def test_broken_download_resumes(hub, tmp_path, tiny_path):
    """A download that breaks off halfway is resumed by the hub library with a Range request, and only the
    whole file is used; ``download_dir`` is the cache it lands in."""
    data = (Path(tiny_path) / "model.safetensors").read_bytes()
    hub.repos[FLAKY] = FakeRepo(Path(tiny_path), commit="4" * 40, drop_once={"model.safetensors"})
    # The library keeps what it has read in whole chunks (10 MiB); small chunks let the tiny file resume mid-way.
    code = (f"import json; from huggingface_hub import constants; constants.DOWNLOAD_CHUNK_SIZE = 4096; "
            f"from model_registry.source import resolve_model_source as r; "
            f"print(json.dumps({{'path': r({FLAKY!r}, download_dir={str(tmp_path / 'dl')!r}).path}}))")
    got, err = run_py(code, hub, tmp_path / "home")
    assert Path(got["path"]) == (tmp_path / "dl" / "models--org--flaky-llama" / "snapshots" / ("4" * 40)).resolve()
    assert "resume" in err  # the library's own warning
    assert (Path(got["path"]) / "model.safetensors").read_bytes() == data
    ranges = [r[2] for r in hub.file_requests("model.safetensors") if r[0] == "GET" and "/flaky-llama/" in r[1]]
    assert ranges[0] is None and ranges[-1].startswith("bytes=") and ranges[-1].endswith("-")
    assert 0 < int(ranges[-1][len("bytes="):-1]) <= len(data) // 2  # resumed from what had arrived
    assert not list(tmp_path.rglob("*.incomplete"))


def test_serve_by_repo_id_offline_from_the_cache(hub, home, tiny_path):
    """`vllite serve org/name --revision v1` with HF_HUB_OFFLINE=1 serves the model the download test put in
    the cache, without one request to the Hub (the real openai client)."""
    import openai
    from server_harness import ServerProcess
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (home / "hub" / "models--org--tiny-llama" / "snapshots" / COMMIT / "model.safetensors").is_file():
        run_py(GENERATE, hub, home)  # this test ran alone: download first
    ref = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    want = AutoTokenizer.from_pretrained(tiny_path).decode(hf_greedy(ref, PROMPT, 8))
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    before = len(hub.requests)
    srv = ServerProcess([LLAMA, "--revision", "v1", "--dtype", "float32", "--num-kv-blocks", "32"], env=env)
    try:
        client = openai.OpenAI(base_url=srv.wait_ready() + "/v1", api_key="none")
        assert [m.id for m in client.models.list().data] == [LLAMA]
        out = client.completions.create(model=LLAMA, prompt=PROMPT, temperature=0, max_tokens=8,
                                        extra_body={"ignore_eos": True, "skip_special_tokens": False})
    finally:
        srv.stop()
    assert out.choices[0].text == want
    assert len(hub.requests) == before  # offline: the cache only


def test_repo_refs_and_quant_names():
    from model_registry.hub import HubFileNotFoundError, HubModelRef, parse_repo_ref, pick_gguf_file

    assert parse_repo_ref("Qwen/Qwen2.5-0.5B-Instruct") == HubModelRef("Qwen/Qwen2.5-0.5B-Instruct")
    assert parse_repo_ref("unsloth/Qwen3-0.6B-GGUF:Q4_K_M") == HubModelRef("unsloth/Qwen3-0.6B-GGUF", "Q4_K_M")
    for local in ("./org/name", "/abs/org/name", "~/org/name", "a/b/c", "no-slash"):
        assert parse_repo_ref(local) is None
    files = ["m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "m.Q8_0.gguf", "README.md", "m-Q4_K_M.gguf.sha256"]
    assert pick_gguf_file(files, "q4_k_m", "r") == "m-Q4_K_M.gguf"
    assert pick_gguf_file(files, "Q8_0", "r") == "m.Q8_0.gguf"
    with pytest.raises(HubFileNotFoundError, match="no GGUF file matches quant 'Q4_K'"):
        pick_gguf_file(files, "Q4_K", "r")  # a prefix of Q4_K_M / Q4_K_S is no match
