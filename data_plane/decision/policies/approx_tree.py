"""`approx_tree`: SGLang router's cache_aware, a router-side approximate radix tree of the prompts
sent to each worker (a baseline: reads no index)."""

from __future__ import annotations

import heapq
import itertools
import random
from array import array
from collections.abc import Collection, Sequence

from kvroute.block_keys import pack_token_ids
from kvroute.data_plane.decision.policies.base import (
    NEEDS_TOKENS,
    Candidate,
    Choice,
    RoutingInput,
    make_rng,
    others_by_load,
    pick_one,
    request_load,
    require_candidates,
)
from kvroute.data_plane.decision.policies.load_balancing import LeastLoaded

# SGLang router defaults (sgl-router's Python launcher, RouterArgs): cache_threshold 0.3,
# balance_abs_threshold 64, balance_rel_threshold 1.5, eviction_interval_secs 120, max_tree_size
# 2**26 characters per worker. (Its Rust CacheAwareConfig::default has other values, 0.5/32/1.1/30 s/
# 10000, used only when the struct is built without the launcher.) Our tree holds token ids where
# SGLang's holds characters, so max_tree_size becomes 2**26 / 4 = 2**24 tokens (~4 characters a token).
APPROX_CACHE_THRESHOLD = 0.3
APPROX_BALANCE_ABS_THRESHOLD = 64
APPROX_BALANCE_REL_THRESHOLD = 1.5
APPROX_MAX_TREE_TOKENS = 2**24

_CHUNK = 64  # tokens compared per C-level slice comparison when looking for where two runs diverge


def _as_tokens(token_ids: Sequence[int]) -> array:
    try:
        return pack_token_ids(token_ids)  # packed prompts (tokenizer, simulator) pass through uncopied
    except ValueError:  # ids past 2**32 (no tokenizer has them); still correct, twice the memory
        return array("q", token_ids)


def _common_prefix(edge: array, tokens: array, start: int) -> int:
    """How many leading tokens of `edge` equal tokens[start:]; O(result) with C-level comparisons."""
    n = min(len(edge), len(tokens) - start)
    if tokens[start : start + n] == edge[:n]:  # the usual case: the whole edge matches
        return n
    k = 0  # a mismatch lies before n, so both loops stop in range
    while tokens[start + k : start + k + _CHUNK] == edge[k : k + _CHUNK]:
        k += _CHUNK
    while tokens[start + k] == edge[k]:
        k += 1
    return k


class _Node:
    __slots__ = ("children", "edge", "end", "parent", "tenants")

    def __init__(self, edge: array, end: int, parent: _Node | None) -> None:
        self.edge = edge  # the run of tokens on the edge into this node
        self.end = end  # prompt offset where the edge ends (the node's depth)
        self.parent = parent
        self.children: dict[int, _Node] = {}  # first token of a child's edge -> child
        self.tenants: dict[str, int] = {}  # worker id -> last use (logical clock)


class PromptTree:
    """The prompts this router sent, per worker, in one radix tree (runs of tokens per edge), each
    node tagged with the workers that were sent it and when (a logical clock: no I/O, no time).

    - insert(tokens, worker) and match(tokens, workers) are O(prompt length): one dict lookup per
      node on the path and C-level comparisons of token runs;
    - a worker's size is the number of tokens on the nodes tagged with it (SGLang's
      tenant_char_count); past `max_tokens_per_worker`, its least recently used leaves are evicted
      right away (SGLang evicts from a background thread every eviction_interval_secs; a pure policy
      has no thread or clock, and evicting on insert keeps the bound at all times).

    Why LRU eviction always finds a leaf: every insert tags the whole path with the same clock value,
    so a node is never older than its descendants for a worker; each worker's heap orders by
    (last use, deeper first), so its minimum is a node none of whose children carry the worker.
    A node that no worker carries is unlinked (its descendants carried no worker either)."""

    def __init__(self, max_tokens_per_worker: int = APPROX_MAX_TREE_TOKENS) -> None:
        if max_tokens_per_worker < 1:
            raise ValueError("max_tokens_per_worker must be >= 1")
        self.max_tokens = max_tokens_per_worker
        self._root = _Node(array("I"), 0, None)
        self._size: dict[str, int] = {}
        self._nodes: dict[str, int] = {}  # worker -> nodes tagged with it (when to compact its heap)
        self._lru: dict[str, list[tuple[int, int, int, _Node]]] = {}  # worker -> heap of (used, -end, seq, node)
        self._clock = 0
        self._seq = itertools.count()

    def size(self, worker: str) -> int:
        return self._size.get(worker, 0)

    def node_count(self) -> int:
        count, stack = 0, [self._root]
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children.values())
        return count - 1

    def match(self, token_ids: Sequence[int], workers: Collection[str]) -> tuple[int, list[str]]:
        """(longest prefix of the prompt sent to any of `workers`, the workers it was sent to)."""
        tokens = _as_tokens(token_ids)
        node, i, holders = self._root, 0, []
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            live = [w for w in child.tenants if w in workers]
            if not live:  # a child's workers are a subset of its parent's: nothing deeper either
                break
            k = _common_prefix(child.edge, tokens, i)
            i, holders = i + k, live
            if k < len(child.edge):
                break
            node = child
        return i, holders

    def insert(self, token_ids: Sequence[int], worker: str) -> None:
        tokens = _as_tokens(token_ids)
        self._clock += 1
        self._size.setdefault(worker, 0)
        self._nodes.setdefault(worker, 0)
        heap = self._lru.setdefault(worker, [])
        node, i = self._root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                child = node.children[tokens[i]] = _Node(tokens[i:], len(tokens), node)
            else:
                k = _common_prefix(child.edge, tokens, i)
                if k < len(child.edge):
                    child = self._split(child, k)
            self._tag(child, worker, self._clock, heap)
            node, i = child, child.end
        self._evict(worker, heap)

    def _tag(self, node: _Node, worker: str, used: int, heap: list) -> None:
        if worker not in node.tenants:
            self._size[worker] += len(node.edge)
            self._nodes[worker] += 1
        node.tenants[worker] = used
        heapq.heappush(heap, (used, -node.end, next(self._seq), node))

    def _split(self, node: _Node, k: int) -> _Node:
        """Cut node's edge after k tokens; the new upper node inherits its workers and last uses
        (sizes do not change: the same tokens, on two nodes)."""
        parent = node.parent
        assert parent is not None
        upper = _Node(node.edge[:k], node.end - len(node.edge) + k, parent)
        upper.tenants = dict(node.tenants)
        for w, used in upper.tenants.items():
            self._nodes[w] += 1
            heapq.heappush(self._lru[w], (used, -upper.end, next(self._seq), upper))
        node.edge = node.edge[k:]
        node.parent = upper
        upper.children[node.edge[0]] = node
        parent.children[upper.edge[0]] = upper
        return upper

    def _evict(self, worker: str, heap: list) -> None:
        while self._size[worker] > self.max_tokens and heap:
            used, _, _, node = heapq.heappop(heap)
            if node.tenants.get(worker) != used:
                continue  # stale entry: used again since, or already evicted
            del node.tenants[worker]
            self._size[worker] -= len(node.edge)
            self._nodes[worker] -= 1
            if not node.tenants and node.parent is not None:
                del node.parent.children[node.edge[0]]
        if len(heap) > 2 * self._nodes[worker] + 64:  # drop stale entries so the heap stays O(tree)
            heap[:] = [e for e in heap if e[3].tenants.get(worker) == e[0]]
            heapq.heapify(heap)


class ApproxTree:
    """`approx_tree`: SGLang router's cache_aware policy, with token ids as the tree's "characters"
    (SGLang matches the request text; the simulator has no text, and the router has the tokens).

    1. Imbalanced (max_load - min_load > balance_abs_threshold AND max_load > balance_rel_threshold
       * min_load): the least loaded worker (seeded tie-break).
    2. Else the longest prefix match among the candidates in this router's tree: if
       matched / prompt_tokens > cache_threshold, a worker holding that match (seeded choice among
       them; SGLang takes whichever its map yields first);
    3. else the worker with the smallest tree (fewest tokens sent and not evicted: "most free cache";
       seeded tie-break, so a cold fleet spreads).
    In every case the prompt is then recorded on the chosen worker: the policy is stateful, the tree
    is this router's own view (a /v1/route probe counts as a send, like round_robin's turn). Workers
    that leave the fleet keep their (bounded) share of the tree until evicted. Scores: 0 for the
    chosen worker, 1 + load for the rest."""

    name = "approx_tree"
    needs = NEEDS_TOKENS

    def __init__(
        self,
        cache_threshold: float = APPROX_CACHE_THRESHOLD,
        balance_abs_threshold: int = APPROX_BALANCE_ABS_THRESHOLD,
        balance_rel_threshold: float = APPROX_BALANCE_REL_THRESHOLD,
        max_tree_size: int = APPROX_MAX_TREE_TOKENS,
        seed: int | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold, self.balance_rel_threshold = balance_abs_threshold, balance_rel_threshold
        self.tree = PromptTree(max_tree_size)
        self._rng = make_rng(seed, rng)
        self._least = LeastLoaded(rng=self._rng)

    def choose(self, request: RoutingInput, candidates: list[Candidate]) -> Choice:
        require_candidates(candidates)
        loads = {c.worker_id: request_load(c) for c in candidates}
        hi, lo = max(loads.values()), min(loads.values())
        tokens = _as_tokens(request.token_ids)
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            chosen = self._least.choose(request, candidates).worker
        else:
            matched, holders = self.tree.match(tokens, loads.keys())
            if tokens and matched / len(tokens) > self.cache_threshold:
                pool = [c for c in candidates if c.worker_id in holders]
            else:
                smallest = min(self.tree.size(c.worker_id) for c in candidates)
                pool = [c for c in candidates if self.tree.size(c.worker_id) == smallest]
            chosen = pick_one(pool, self._rng)  # in candidate order: reproducible
        self.tree.insert(tokens, chosen.worker_id)
        return Choice(chosen, others_by_load(chosen, candidates))
