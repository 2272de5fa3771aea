"""Print pip's certificate bundle (for SSL_CERT_FILE; an empty line when none), then, one per line, the uv options
that give ``uv pip install`` the package sources pip is configured with.

uv reads no pip.conf and no PIP_* variables; on a machine whose pip is set up with local wheel folders, mirror
indexes or constraints (CI images, air-gapped hosts), uv would otherwise ask pypi.org alone: here that fetches
a CUDA torch. This asks pip itself (``pip config list``: files and environment, the environment winning) and
maps what changes where packages come from.

    python scripts/uv_pip_args.py PIP
"""
from __future__ import annotations

import ast
import subprocess
import sys

# pip's option -> uv's, for the options that say where packages come from.
_FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
          "constraint": "--constraint"}
_SECTIONS = ("global", "install", ":env:")  # later sections win, as in pip


def pip_config(pip: str) -> dict[str, str]:
    out = subprocess.run([pip, "config", "list"], capture_output=True, text=True, check=True).stdout
    by_section: dict[str, dict[str, str]] = {s: {} for s in _SECTIONS}
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        section, _, name = key.rpartition(".")
        if sep and section in by_section:
            by_section[section][name] = ast.literal_eval(value)
    merged: dict[str, str] = {}
    for section in _SECTIONS:
        merged.update(by_section[section])
    return merged


def main() -> None:
    config = pip_config(sys.argv[1])
    args = [config.get("cert", "")]
    for name, flag in _FLAGS.items():
        for value in config.get(name, "").split():
            args += [flag, value]
    if config.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        args.append("--no-index")
    # pip takes the best version across all its indexes; uv by default only the first index that has the name.
    args += ["--index-strategy", "unsafe-best-match"]
    print("\n".join(args))


if __name__ == "__main__":
    main()
