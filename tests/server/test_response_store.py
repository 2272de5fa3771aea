"""The Responses store stays under its size bound: the oldest responses go first."""
from __future__ import annotations

from vllite_core.entrypoints.openai.protocol import ChatMessage
from vllite_core.entrypoints.openai.serving_responses import ResponseStore


def test_oldest_dropped_past_the_bound():
    store = ResponseStore(max_chars=2000)
    for i in range(50):
        store.put({"id": f"resp_{i}", "output": "x" * 100}, [ChatMessage(role="user", content="y" * 100)])
        assert store.chars <= 2000
    kept = list(store.items)
    assert kept == [f"resp_{i}" for i in range(50 - len(kept), 50)] and 0 < len(kept) < 50
    assert store.get("resp_0") is None
    conv, resp = store.get("resp_49")
    assert resp["id"] == "resp_49" and conv[0].content == "y" * 100
