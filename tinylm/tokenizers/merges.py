"""The merge loop shared by the BPE and llama2.c tokenizers.

Both repeatedly merge the adjacent pair with the best priority, leftmost first. Rescanning the
sequence after every merge is quadratic; a heap over a linked list gives the same merge order in
O(n log n): heap entries are ordered by (priority, position), and position order is left-to-right
order because merging never reorders tokens. Entries whose tokens changed after they were pushed
are skipped when popped.
"""

from __future__ import annotations

import heapq
from typing import Callable

# (left id, right id) -> (priority, merged id), or None when the pair does not merge; lower
# priorities merge first
PairLookup = Callable[[tuple[int, int]], "tuple[float, int] | None"]


def merge_pairs(ids: list[int], lookup: PairLookup) -> list[int]:
    """``ids`` after merging, while any adjacent pair merges, the lowest-priority pair (leftmost
    among equals)."""
    n = len(ids)
    tok = list(ids)
    nxt = list(range(1, n + 1))  # n marks the end
    prv = list(range(-1, n - 1))
    alive = [True] * n
    heap = []
    for i in range(n - 1):
        hit = lookup((tok[i], tok[i + 1]))
        if hit is not None:
            heap.append((hit[0], i, tok[i], tok[i + 1], hit[1]))
    heapq.heapify(heap)
    while heap:
        _, i, a, b, new = heapq.heappop(heap)
        j = nxt[i]
        if not alive[i] or tok[i] != a or j >= n or tok[j] != b:
            continue
        tok[i] = new
        alive[j] = False
        k = nxt[i] = nxt[j]
        if k < n:
            prv[k] = i
            hit = lookup((new, tok[k]))
            if hit is not None:
                heapq.heappush(heap, (hit[0], i, new, tok[k], hit[1]))
        p = prv[i]
        if p >= 0:
            hit = lookup((tok[p], new))
            if hit is not None:
                heapq.heappush(heap, (hit[0], p, tok[p], new, hit[1]))
    out, i = [], 0
    while i < n:
        out.append(tok[i])
        i = nxt[i]
    return out
