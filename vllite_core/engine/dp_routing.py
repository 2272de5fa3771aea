"""Which data-parallel engine core takes a request: the least loaded, unless another holds its prefix.

Each engine core keeps its own prefix cache, so a request whose first blocks an earlier request already
computed runs its prefill faster on the engine that computed them. ``PrefixRouter`` remembers, for the
first full blocks of recent prompts, which engine each went to (chained per block, with the request's
``cache_salt``, LoRA adapter and extra block keys folded in as the cores fold them into their block
hashes, so a salted prompt never follows another tenant's). A request goes to the engine holding its
longest remembered prefix when that engine has at most ``slack`` more unfinished requests than the least
loaded one, else to the least loaded: cache affinity weighed against load, as SGLang's router does.
Python's ``hash`` is enough here: only this process compares the keys.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence


class PrefixRouter:
    """Prefix -> engine index, for the first ``max_blocks`` full blocks of the prompts routed lately."""

    def __init__(self, block_size: int, slack: int = 4, max_blocks: int = 128, capacity: int = 1 << 17) -> None:
        self.block_size = block_size
        self.slack = slack
        self.max_blocks = max_blocks
        self.capacity = capacity
        self._holder: OrderedDict[int, int] = OrderedDict()  # chained block key -> engine index (LRU order)

    def prefix_keys(self, token_ids: Sequence[int], seed: Hashable) -> list[int]:
        """One key per full block of the prompt's first ``max_blocks``, each covering its whole prefix."""
        bs = self.block_size
        keys: list[int] = []
        key = hash(seed)
        for start in range(0, min(len(token_ids) // bs, self.max_blocks) * bs, bs):
            key = hash((key, tuple(token_ids[start:start + bs])))
            keys.append(key)
        return keys

    def choose(self, keys: list[int], loads: dict[int, int]) -> int:
        """The engine for a prompt with these keys among the live ones (``loads``: index -> unfinished
        requests), and remember its prefix there."""
        least = min(loads, key=lambda i: (loads[i], i))
        chosen = least
        for key in reversed(keys):
            held = self._holder.get(key)
            if held is not None:
                if held in loads and loads[held] <= loads[least] + self.slack:
                    chosen = held
                break
        for key in keys:
            self._holder[key] = chosen
            self._holder.move_to_end(key)
        while len(self._holder) > self.capacity:
            self._holder.popitem(last=False)
        return chosen

    def forget_engine(self, index: int) -> None:
        """An engine core died: its prefix cache went with it."""
        for key in [k for k, i in self._holder.items() if i == index]:
            del self._holder[key]
