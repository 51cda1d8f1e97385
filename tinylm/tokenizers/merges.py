"""The merge machinery shared by the BPE tokenizers (byte-level and word-level) and llama2.c.

Training (``learn_merges``): the most frequent adjacent pair is merged, again and again; ties go
to the smallest (left id, right id). Pairs are counted at every position (so "aaa" holds (a, a)
twice) and a merge replaces occurrences left to right without overlap.

Encoding (``merge_pairs``) repeatedly merges the adjacent pair with the best priority, leftmost
first. Rescanning the sequence after every merge is quadratic; a heap over a linked list gives the
same merge order in O(n log n): heap entries are ordered by (priority, position), and position order is left-to-right
order because merging never reorders tokens. Entries whose tokens changed after they were pushed
are skipped when popped.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
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


def learn_merges(words: list[list[int]], freqs: list[int], n_merges: int, first_id: int) -> list[tuple[int, int]]:
    """The merge list for pre-tokens ``words`` (token ids, rewritten in place) seen ``freqs`` times;
    merge i makes token ``first_id + i``.

    Pair counts are updated incrementally: a merge rewrites only the pre-tokens that hold the
    pair, subtracting their old pairs and adding their new ones.
    """
    pair_counts: dict[tuple[int, int], int] = defaultdict(int)
    where: dict[tuple[int, int], set[int]] = defaultdict(set)
    for wi, (w, f) in enumerate(zip(words, freqs)):
        for pair in zip(w, w[1:]):
            pair_counts[pair] += f
            where[pair].add(wi)
    heap = [(-c, p) for p, c in pair_counts.items()]
    heapq.heapify(heap)

    merges: list[tuple[int, int]] = []
    while len(merges) < n_merges and heap:
        neg, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -neg or -neg <= 0:
            continue  # stale heap entry: the count changed after it was pushed
        new_id = first_id + len(merges)
        merges.append(pair)
        changed: set[tuple[int, int]] = set()
        for wi in where.pop(pair):
            w, f = words[wi], freqs[wi]
            for p in zip(w, w[1:]):  # remove this word's old pairs
                pair_counts[p] -= f
                changed.add(p)
            merged = merge_pair(w, pair, new_id)
            words[wi] = merged
            for p in zip(merged, merged[1:]):
                pair_counts[p] += f
                where[p].add(wi)  # may leave stale members elsewhere; rewriting them is a no-op
                changed.add(p)
        pair_counts.pop(pair, None)
        changed.discard(pair)
        for p in changed:
            c = pair_counts.get(p, 0)
            if c > 0:
                heapq.heappush(heap, (-c, p))
            else:
                pair_counts.pop(p, None)
                where.pop(p, None)
    return merges


def merge_pair(ids: list[int], pair: tuple[int, int], new_id: int) -> list[int]:
    """Replace every non-overlapping occurrence of ``pair`` (left to right) with ``new_id``."""
    a, b = pair
    if len(ids) == 2:  # the common last step of short pieces
        return [new_id] if ids[0] == a and ids[1] == b else list(ids)
    out, i, n = [], 0, len(ids)
    while i < n:
        if i < n - 1 and ids[i] == a and ids[i + 1] == b:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out
