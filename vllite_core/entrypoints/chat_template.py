"""``--chat-template``: a file path or the template itself (vLLM's rule), read once at start-up.

The text is only stored here; it is rendered where every template is, by the tokenizer's
``apply_chat_template`` (transformers' jinja2 ImmutableSandboxedEnvironment), so a server
template is sandboxed exactly like a request's ``chat_template``."""
from __future__ import annotations

import os

_TEMPLATE_CHARS = set("{}\n")


def load_chat_template(value: str | None) -> str | None:
    """The template text: the file's contents when ``value`` names a file, ``value`` itself when it
    looks like a template (has ``{``, ``}`` or a newline); ValueError for a path that does not exist."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if _TEMPLATE_CHARS & set(value):
        return value
    raise ValueError(f"--chat-template {value!r}: no such file, and it does not look like a jinja template")
