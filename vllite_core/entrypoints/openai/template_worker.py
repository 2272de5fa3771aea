"""The chat-template renderer process (template_sandbox.TemplateSandbox starts it by file path with
``python -I``, so neither the vllite package nor torch is imported here).

A chat template is a program: jinja2's sandbox stops it reaching Python internals but not looping
for hours or building a 1.5 GB string. This process imports the renderer once, then forks one
child per job: the child caps its address space (``RLIMIT_AS``: what it has plus the memory
budget) and its CPU time (the time budget), lowers its priority and renders; this process reads at
most the output budget and kills the child past it or past a wall-clock backstop. So this process
never runs template code itself and is never wedged by one. Jobs arrive as one JSON line each on
stdin; replies leave as one JSON line each on stdout: ``{"text": ...}`` or
``{"error": KIND, "message": ...}``. JSON, never pickle: the parent must not trust what a
template could have shaped.
"""
from __future__ import annotations

import json
import math
import os
import resource
import select
import signal
import sys
import time


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _render(job: dict, max_chars: int) -> dict:
    from jinja2.exceptions import SecurityError, TemplateSyntaxError
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        rendered, _ = render_jinja_template(
            conversations=[job["conversation"]], tools=job.get("tools"), chat_template=job["template"],
            continue_final_message=job.get("continue_final_message", False),
            add_generation_prompt=job.get("add_generation_prompt", False), **job.get("kwargs", {}))
    except MemoryError:
        return {"error": "memory", "message": "the chat template used more memory than its budget"}
    except RecursionError:
        return {"error": "memory", "message": "the chat template recursed too deeply"}
    except SecurityError as e:
        return {"error": "unsafe", "message": str(e)}
    except TemplateSyntaxError as e:
        return {"error": "syntax", "message": str(e)}
    except Exception as e:  # templates that raise on a role order, bad arguments...
        return {"error": "render", "message": f"{type(e).__name__}: {e}"}
    text = rendered[0]
    if len(text) > max_chars:
        return {"error": "size", "message": f"the chat template's output ({len(text)} characters) is over the "
                f"{max_chars}-character budget"}
    return {"text": text}


def _child(job: dict, timeout_s: float, max_chars: int, memory_bytes: int, wfd: int) -> None:
    """In the forked child: cap, render, write the reply, exit (never returns). The time budget is
    CPU time (``RLIMIT_CPU``: SIGXCPU ends the child), so a loaded machine does not fail a cheap
    template; the parent's wall-clock deadline is only the backstop."""
    try:
        os.nice(5)  # a spinning template yields the CPU to the server and the engine
        limit = _vm_size() + memory_bytes
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        cpu = max(1, math.ceil(timeout_s))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        try:
            data = json.dumps(_render(job, max_chars), ensure_ascii=False).encode()
        except MemoryError:
            data = b'{"error": "memory", "message": "the chat template used more memory than its budget"}'
        view = memoryview(data)
        while view:
            view = view[os.write(wfd, view):]
    finally:
        os._exit(0)


def _run_job(line: str, timeout_s: float, max_chars: int, memory_bytes: int) -> dict:
    job = json.loads(line)
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rfd)
        _child(job, timeout_s, max_chars, memory_bytes, wfd)
    os.close(wfd)
    deadline = time.monotonic() + wall_budget(timeout_s)
    chunks, size, cap = [], 0, 6 * max_chars + 4096
    reply: dict | None = None
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([rfd], [], [], left)[0]:
                reply = {"error": "timeout", "message": f"the chat template took over {timeout_s:g} s to render"}
                break
            chunk = os.read(rfd, 1 << 20)
            if not chunk:
                break
            size += len(chunk)
            if size > cap:
                reply = {"error": "size", "message": "the chat template's output is over its budget"}
                break
            chunks.append(chunk)
    finally:
        os.close(rfd)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _, status = os.waitpid(pid, 0)
    if reply is not None:
        return reply
    try:
        return json.loads(b"".join(chunks))
    except ValueError:  # the child died before it answered
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGXCPU:
            return {"error": "timeout", "message": f"the chat template took over {timeout_s:g} s of CPU to render"}
        return {"error": "memory", "message": "the chat template's render process died (over its memory budget)"}


def wall_budget(timeout_s: float) -> float:
    """The wall-clock backstop of a render whose CPU budget is ``timeout_s`` (a niced child on a busy
    machine gets less than a core)."""
    return 4 * max(1.0, timeout_s) + 1.0


def main() -> None:
    timeout_s, max_chars, memory_bytes = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    sys.path += [p for p in os.environ.get("VLLITE_TEMPLATE_WORKER_PATH", "").split(os.pathsep)
                 if p and p not in sys.path]  # the server's path (run with -I: none of PYTHON*)
    import jinja2  # noqa: F401  (imported once, shared by every forked child)
    from transformers.utils import chat_template_utils  # noqa: F401

    out = sys.stdout
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        out.write(json.dumps(_run_job(line, timeout_s, max_chars, memory_bytes), ensure_ascii=False) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
