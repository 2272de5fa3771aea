"""One image of a request, as the scheduler, the KV cache manager and the runner see it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(eq=False)
class MultiModalFeature:
    """An image's placeholder range in the prompt and what its encoder needs.

    ``identifier`` is the content hash: it keys the encoder cache (shared across requests) and goes into the
    hash of every KV block the range overlaps. ``data`` is the model's processed input (pixels), opaque to
    the core and given back to ``model.embed_multimodal``."""

    modality: str
    identifier: str
    offset: int  # first placeholder token's position in the prompt
    length: int  # placeholder tokens = embedding rows the encoder produces
    data: Any = None

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        return self.offset < end and start < self.end


def expand_placeholders(token_ids: Sequence[int], placeholder_id: int, lengths: Sequence[int]
                        ) -> tuple[list[int], list[int]]:
    """Each occurrence of ``placeholder_id`` (one per item, in order) repeated ``lengths[i]`` times; returns
    (expanded ids, each item's offset). The caller has checked the counts agree."""
    out, offsets = expand_each(token_ids, {placeholder_id: lengths})
    return out, offsets[placeholder_id]


def expand_each(token_ids: Sequence[int], lengths: dict[int, Sequence[int]]
                ) -> tuple[list[int], dict[int, list[int]]]:
    """``expand_placeholders`` for several placeholder ids at once (images and videos): the n-th occurrence of
    id ``k`` becomes ``lengths[k][n]`` copies; returns the expanded ids and each id's items' offsets."""
    out: list[int] = []
    offsets: dict[int, list[int]] = {k: [] for k in lengths}
    for tok in token_ids:
        if tok in lengths:
            offsets[tok].append(len(out))
            out.extend([tok] * lengths[tok][len(offsets[tok]) - 1])
        else:
            out.append(tok)
    return out, offsets


def mm_block_keys(features: Sequence[MultiModalFeature], start: int, end: int) -> tuple:
    """Extra hash keys of the block holding tokens [start, end): each overlapping image's content hash and its
    offset relative to the block (equal placeholder tokens of different images never hash alike)."""
    return tuple(("mm", f.identifier, f.offset - start) for f in features if f.overlaps(start, end))
