"""What a runtime adapter load (/v1/load_lora_adapter) may open, checked before anything is read.

The directory is already inside --lora-allowed-root (``ServedLoRAs.check_path``); here every entry
the loader could open is checked too: a symlink is followed and must land inside the root (a
weights file linked to /etc or another tenant's directory is refused), it must be a regular file (a
FIFO as adapter_config.json would block the loading thread forever) and no larger than the size
cap (a 1 GiB "adapter" would be read into the API process). Names are capped in length and may not
take over a served model name.
"""
from __future__ import annotations

import os
import stat

from vllite_core.entrypoints.openai.errors import bad_request

MAX_LORA_NAME_LEN = 256
DEFAULT_MAX_LORA_BYTES = 1 << 30  # all of an adapter's files together
MAX_LORA_FILES = 64


def check_lora_name(name: str, served: set[str]) -> None:
    if not name:
        raise bad_request("must be a non-empty name", "lora_name")
    if len(name) > MAX_LORA_NAME_LEN:
        raise bad_request(f"at most {MAX_LORA_NAME_LEN} characters, got {len(name)}", "lora_name")
    if name in served:
        raise bad_request(f"an adapter or model named {name!r} is already served", "lora_name")


def check_adapter_dir(directory: str, root: str, max_bytes: int = DEFAULT_MAX_LORA_BYTES) -> None:
    """400 naming ``lora_path`` unless every file directly in ``directory`` (what the loader reads)
    resolves inside ``root``, is a regular file, and together they fit ``max_bytes``."""
    try:
        entries = list(os.scandir(directory))
    except OSError as e:
        raise bad_request(f"cannot read the adapter directory: {e.strerror or e}", "lora_path") from None
    if len(entries) > MAX_LORA_FILES:
        raise bad_request(f"the adapter directory holds {len(entries)} entries, over {MAX_LORA_FILES}", "lora_path")
    total = 0
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            continue  # never read by the loader
        real = os.path.realpath(entry.path)
        if os.path.commonpath([real, root]) != root:
            raise bad_request(f"{entry.name} links outside the server's --lora-allowed-root", "lora_path")
        try:
            st = os.stat(real)
        except OSError as e:
            raise bad_request(f"{entry.name}: {e.strerror or e}", "lora_path") from None
        if not stat.S_ISREG(st.st_mode):
            raise bad_request(f"{entry.name} is not a regular file", "lora_path")
        total += st.st_size
        if total > max_bytes:
            raise bad_request(f"the adapter's files are over the {max_bytes}-byte limit (--max-lora-adapter-bytes)",
                              "lora_path")
