"""--chat-template: a file path or the template text (vLLM's rule)."""
from __future__ import annotations

import pytest

from vllite_core.entrypoints.chat_template import load_chat_template


def test_file_inline_and_missing(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(f)) == "{{ messages[0]['content'] }}"
    assert load_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{% for")
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
