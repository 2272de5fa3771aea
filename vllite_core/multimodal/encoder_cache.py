"""The scheduler's view of the encoder cache: which images' encoder outputs the runner holds, which must be
computed in this step, and which to evict.

Entries are keyed by content hash and shared by every request showing the same image. A request holds a
reference on an entry from the step its scheduled range first reaches the image until its computed tokens
pass the image's last placeholder (or it finishes or is preempted); unreferenced entries stay cached and are
evicted least recently used first when room is needed. The runner's cache mirrors this one exactly: it is told
what to compute (``SchedulerOutput.scheduled_encoder_inputs``) and what to drop (``free_encoder_mm_hashes``).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from vllite_core.multimodal.features import MultiModalFeature


@dataclass
class EncoderCacheStats:
    """Image lookups (an image reached by a request's scheduled range), how many found the output cached, and
    outputs evicted to make room (vLLM's mm_cache_queries / mm_cache_hits count items the same way)."""

    queries: int = 0
    hits: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class EncoderCacheManager:
    def __init__(self, cache_size: int, budget: int, whole_items: bool = False) -> None:
        self.cache_size = cache_size  # embedding rows the runner keeps
        self.budget = budget  # embedding rows the encoder may compute in one step
        # An item's placeholders attend to one another (Gemma 3): a step takes all of an item's remaining
        # placeholders or stops before it, never cutting it.
        self.whole_items = whole_items
        self.entries: OrderedDict[str, int] = OrderedDict()  # hash -> rows, unreferenced ones in LRU order
        self.refs: dict[str, set[str]] = {}  # hash -> ids of requests holding it
        self.held: dict[str, set[str]] = {}  # request id -> hashes it holds
        self.used = 0
        self.freed: list[str] = []  # evicted since the last step's output
        self.stats = EncoderCacheStats()

    # ---- one step ---------------------------------------------------------------------------------
    def plan(self, req, start: int, num_tokens: int, step_rows: int) -> tuple[int, list[MultiModalFeature], int]:
        """Tokens ``req`` may compute from ``start`` (at most ``num_tokens``): the range stops before the first
        image whose output is not cached (entries made earlier in this step count) and does not fit in the
        step's encoder budget (``step_rows`` used so far) or in the cache, and, with ``whole_items``, before
        an image the range would cut. Returns (tokens, images to encode for it, their rows)."""
        self._release_passed(req, start)  # their rows may make room for the next image (adjacent tiles)
        end = start + num_tokens
        todo: list[MultiModalFeature] = []
        rows = 0
        for f in req.mm_features:
            if not f.overlaps(start, end):
                continue
            if self.whole_items and end < f.end:
                end = f.offset
                break
            if f.identifier in self.entries or any(t.identifier == f.identifier for t in todo):
                continue
            if step_rows + rows + f.length > self.budget or not self._can_fit(rows + f.length):
                end = f.offset
                break
            todo.append(f)
            rows += f.length
        return max(0, end - start), todo, rows

    def _can_fit(self, rows: int) -> bool:
        evictable = sum(n for h, n in self.entries.items() if not self.refs.get(h))
        return self.cache_size - self.used + evictable >= rows

    def commit(self, req, start: int, num_tokens: int, todo: list[MultiModalFeature]) -> None:
        """``req`` was scheduled for [start, start + num_tokens): reference every image the range reaches (new
        ones are allocated, evicting unreferenced entries), release the images it has passed."""
        end = start + num_tokens
        new = {f.identifier for f in todo}
        self._release_passed(req, start)
        for f in req.mm_features:
            if f.overlaps(start, end):
                if f.identifier not in self.entries:
                    self._allocate(f.identifier, f.length)
                if f.identifier not in self.held.get(req.request_id, ()):
                    self.stats.queries += 1
                    self.stats.hits += f.identifier not in new
                self.refs.setdefault(f.identifier, set()).add(req.request_id)
                self.held.setdefault(req.request_id, set()).add(f.identifier)
                self.entries.move_to_end(f.identifier)

    def _release_passed(self, req, start: int) -> None:
        """Drop ``req``'s references on the images its computed tokens (``start``) have passed."""
        needed = {f.identifier for f in req.mm_features if f.end > start}
        for mm_hash in list(self.held.get(req.request_id, ())):
            if mm_hash not in needed:
                self._release(req.request_id, mm_hash)

    def _allocate(self, mm_hash: str, rows: int) -> None:
        while self.used + rows > self.cache_size:
            victim = next((h for h in self.entries if not self.refs.get(h)), None)
            if victim is None:
                raise RuntimeError("encoder cache: no room (a plan was committed that does not fit)")
            self.used -= self.entries.pop(victim)
            self.refs.pop(victim, None)
            self.freed.append(victim)
            self.stats.evictions += 1
        self.entries[mm_hash] = rows
        self.used += rows

    def _release(self, rid: str, mm_hash: str) -> None:
        held = self.held.get(rid)
        if held is None or mm_hash not in held:
            return
        held.discard(mm_hash)
        if not held:
            del self.held[rid]
        refs = self.refs.get(mm_hash)
        if refs is not None:
            refs.discard(rid)

    def release_all(self, req) -> None:
        """The request finished or was preempted: its images stay cached but unreferenced."""
        for mm_hash in list(self.held.get(req.request_id, ())):
            self._release(req.request_id, mm_hash)

    def step(self) -> "EncoderStep":
        """The bookkeeping of one schedule() call."""
        return EncoderStep(self)

    def take_freed(self) -> list[str]:
        out, self.freed = self.freed, []
        return out


class EncoderStep:
    """One schedule() call's encoder decisions: a request's range is planned with its token count (``plan``),
    committed when the request is scheduled (``commit``); images to encode go to the runner with the output."""

    def __init__(self, cache: EncoderCacheManager) -> None:
        self.cache = cache
        self.rows = 0  # encoder rows this step computes
        self.plans: dict[str, tuple[int, list]] = {}  # request id -> (range start, images to encode)
        self.encode: list = []

    def plan(self, req, start: int, n: int, chunked: bool) -> int:
        granted, todo, _ = self.cache.plan(req, start, n, self.rows)
        if granted < n and not chunked:
            granted, todo = 0, []
        self.plans[req.request_id] = (start, todo)
        return granted

    def commit(self, req, n: int) -> None:
        plan = self.plans.pop(req.request_id, None)
        if plan is None:
            return
        start, todo = plan
        self.cache.commit(req, start, n, todo)
        self.rows += sum(f.length for f in todo)
        self.encode.extend(todo)

    def finish(self, out) -> None:
        entries = self.cache.entries
        out.free_encoder_mm_hashes = self.cache.take_freed()
        out.scheduled_encoder_inputs = [f for f in self.encode if f.identifier in entries]
