"""Write (or, with --check, verify) the supported-architectures table in docs/models.md from the model registry.

    python scripts/models_table.py          # rewrite the table
    python scripts/models_table.py --check  # exit 1 when the doc differs from the registry
"""
from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from model_registry.support_table import render, support_rows, updated_doc  # noqa: E402

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "models.md"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that the doc is up to date")
    args = parser.parse_args()
    text = DOC.read_text()
    new = updated_doc(text, render(support_rows()))
    if args.check:
        if new != text:
            print(f"{DOC}: the supported-architectures table is stale; run python scripts/models_table.py")
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
