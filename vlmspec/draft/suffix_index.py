"""The suffix drafter's indexes: where a context's longest suffix occurred before, and the tree of what followed it.

    index = SuffixIndex()                      # token sequences ("documents"), n-grams -> where they end
    doc = index.add([5, 6, 7, 8])              # a document; `extend(doc, tokens)` grows one, at any age
    match = index.match(context)               # Match: longest suffix of `context` found, its occurrences
    tree = frequency_tree(root, match.continuations(index, depth), budget, min_prob)   # DraftTree

In place of a suffix tree: a dict from every n-gram (n = 1..`max_ngram`) to the positions it ends at (oldest
first), each candidate's match extended backwards up to `max_match` tokens. A continuation's empirical
probability is (occurrences passing through it) / (occurrences of the match); memory is `max_ngram` entries per
stored token. `SuffixStore`: one `SuffixIndex` per tenant (None = the shared pool), a token budget over all, the
oldest documents evicted first; an answer joins as it is written (`open`, `extend`), so a request may draft from
another still decoding. It holds a lock, as a service feeds it from other threads.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Hashable

import torch

from vlmspec.tree import DraftTree

_SHIFT = 32  # a position is coded as doc << _SHIFT | offset (documents are shorter than 2**32 tokens)


@dataclass(frozen=True)
class Match:
    """The longest suffix of a context found in an index: its length and where it occurred
    (doc, offset of its last token), most recent first, at most the index's `max_occurrences`."""

    length: int = 0
    where: tuple[tuple[int, int], ...] = ()

    def continuations(self, index: "SuffixIndex", depth: int) -> list[list[int]]:
        """What followed each occurrence, at most `depth` tokens (never empty)."""
        out = []
        for doc, end in self.where:
            seq = index.docs[doc]
            cont = seq[end + 1 : end + 1 + depth]
            if cont:
                out.append(cont)
        return out


@dataclass(frozen=True)
class IndexConfig:
    """How an index matches. max_ngram: the longest n-gram keyed (entries per stored token);
    max_match: how far a match is extended backwards past it (the longest suffix told apart);
    max_occurrences: occurrences of the longest n-gram read per lookup, most recent first."""

    max_ngram: int = 4
    max_match: int = 32
    max_occurrences: int = 64

    def __post_init__(self) -> None:
        if not 1 <= self.max_ngram <= self.max_match or self.max_occurrences < 1:
            raise ValueError(f"need 1 <= max_ngram <= max_match and max_occurrences >= 1, got {self}")


class SuffixIndex:
    """Token sequences ("documents") and the n-grams (n = 1..max_ngram) ending at each of their positions."""

    def __init__(self, config: IndexConfig | None = None) -> None:
        self.config = config or IndexConfig()
        self.docs: dict[int, list[int]] = {}  # insertion order = age, oldest first
        self.grams: dict[tuple[int, ...], deque[int]] = {}  # n-gram -> coded positions of its last token, oldest first
        self.tokens = 0  # tokens over all documents
        self._next = 0
        # documents extended after a newer one was added: their positions are not all before the
        # newer documents' in the n-grams' deques, so evicting them filters instead of popping the left
        self._late: set[int] = set()

    @property
    def entries(self) -> int:
        """Positions held over all n-grams (at most max_ngram per stored token)."""
        return sum(len(d) for d in self.grams.values())

    def add(self, tokens: list[int]) -> int:
        """A new document; returns its id."""
        doc, self._next = self._next, self._next + 1
        self.docs[doc] = []
        self.extend(doc, tokens)
        return doc

    def extend(self, doc: int, tokens: list[int]) -> bool:
        """Append `tokens` to document `doc`, indexing the n-grams that now end at each new position;
        False (nothing done) when `doc` was evicted."""
        seq = self.docs.get(doc)
        if seq is None:
            return False
        if tokens and doc != self._next - 1:
            self._late.add(doc)
        for tok in tokens:
            seq.append(int(tok))
            end = len(seq) - 1
            code = doc << _SHIFT | end
            for n in range(1, min(self.config.max_ngram, end + 1) + 1):
                key = tuple(seq[end - n + 1 : end + 1])
                where = self.grams.get(key)
                if where is None:
                    self.grams[key] = where = deque()
                where.append(code)
        self.tokens += len(tokens)
        return True

    def evict_oldest(self) -> int:
        """Drop the oldest document and its positions; returns its length (0 when empty)."""
        if not self.docs:
            return 0
        doc = next(iter(self.docs))
        seq = self.docs.pop(doc)
        late = doc in self._late
        self._late.discard(doc)
        n_max = self.config.max_ngram
        for key in {tuple(seq[end - n + 1 : end + 1]) for end in range(len(seq)) for n in range(1, min(n_max, end + 1) + 1)}:
            where = self.grams[key]
            if late:  # its positions may sit among newer documents': keep every other one
                where = self.grams[key] = deque(c for c in where if c >> _SHIFT != doc)
            while where and where[0] >> _SHIFT == doc:  # in order: the oldest document's positions come first
                where.popleft()
            if not where:
                del self.grams[key]
        self.tokens -= len(seq)
        return len(seq)

    def match(self, context: list[int], exclude: int | None = None) -> Match:
        """The longest suffix of `context` (at most `max_match` tokens) that occurs followed by at
        least one token, and its occurrences: the longest n-gram's, most recent first, each extended
        backwards; only those reaching the longest extension are kept (the suffix tree's deepest node).
        Document `exclude` is not read (a request's own answer, as it is written)."""
        for n in range(min(self.config.max_ngram, len(context)), 0, -1):
            where = self.grams.get(tuple(context[-n:]))
            found = self._extended(where, context, n, exclude) if where else []
            if found:
                best = max(m for m, _, _ in found)
                return Match(best, tuple((doc, end) for m, doc, end in found if m == best))
        return Match()

    def _extended(self, where: deque[int], context: list[int], n: int, exclude: int | None) -> list[tuple[int, int, int]]:
        """(match length, doc, end) of the most recent occurrences of the context's last `n` tokens
        that something follows, each match extended backwards up to `max_match`."""
        out: list[tuple[int, int, int]] = []
        limit = min(self.config.max_match, len(context))
        for code in reversed(where):
            doc, end = code >> _SHIFT, code & ((1 << _SHIFT) - 1)
            if doc == exclude:
                continue
            seq = self.docs[doc]
            if end + 1 >= len(seq):
                continue  # nothing follows it (the end of the request's own text)
            m = n
            while m < limit and end - m >= 0 and seq[end - m] == context[-1 - m]:
                m += 1
            out.append((m, doc, end))
            if len(out) >= self.config.max_occurrences:
                break
        return out


def frequency_tree(root: int, continuations: list[list[int]], budget: int, min_prob: float = 0.0, top_k: int | None = None) -> DraftTree:
    """The draft tree of `continuations` (what followed each occurrence of a match): their trie,
    each node's probability the share of continuations passing through it (the product of its
    path's empirical child frequencies), the best `budget` nodes of probability >= `min_prob` kept
    (a child never beats its parent, and ties go to the shallower node, so the kept set is closed
    under parents), at most `top_k` children per node (None: no cap). Nodes are laid out breadth
    first, each node's children most frequent first (ties: the most recent occurrence's first), so
    the first-child chain is the likeliest path.
    Returns DraftTree(tokens [N], parents [N], path_probs=[N] float32)."""
    children: list[dict[int, int]] = [{}]
    tokens, parents, counts, depth = [root], [-1], [0], [0]
    for cont in continuations:
        node = 0
        counts[0] += 1
        for tok in cont:
            child = children[node].get(tok)
            if child is None:
                child = children[node][tok] = len(tokens)
                children.append({})
                tokens.append(tok)
                parents.append(node)
                counts.append(0)
                depth.append(depth[node] + 1)
            counts[child] += 1
            node = child
    total = max(counts[0], 1)
    ranked = sorted((i for i in range(1, len(tokens)) if counts[i] / total >= min_prob), key=lambda i: (-counts[i], depth[i], i))
    kept = set(ranked[: max(budget, 0)])
    order, queue = [0], [0]
    for node in queue:  # breadth first over the kept nodes, most frequent child first
        for child in sorted((c for c in children[node].values() if c in kept), key=lambda c: (-counts[c], c))[:top_k]:
            order.append(child)
            queue.append(child)
    new_id = {node: i for i, node in enumerate(order)}
    return DraftTree(torch.tensor([tokens[i] for i in order], dtype=torch.long),
                     torch.tensor([-1, *(new_id[parents[i]] for i in order[1:])], dtype=torch.long),
                     path_probs=torch.tensor([counts[i] / total if i else 1.0 for i in order], dtype=torch.float32))


@dataclass(frozen=True)
class Written:
    """A document a store holds open for appending (`SuffixStore.open`): its tenant, index and id."""

    tenant: Hashable
    index: SuffixIndex
    doc: int


@dataclass
class StoreStats:
    """A store's plain counters (the service's metrics read them)."""

    added_tokens: int = 0  # tokens of answers taken in
    evicted_tokens: int = 0  # tokens dropped, oldest first, to stay within the budget
    added_docs: int = 0
    evicted_docs: int = 0


class SuffixStore:
    """Cross-request memory: one `SuffixIndex` per tenant (None: the shared pool; a tenant's text is
    only ever matched for that tenant), at most `max_tokens` tokens over all tenants, the oldest
    documents (of any tenant) evicted first. `max_tokens` 0 keeps nothing.

    Memory: each stored token costs its list slot and `max_ngram` coded positions (plus the distinct
    n-grams' keys), so the store's size follows `max_tokens`, however long the service runs."""

    def __init__(self, max_tokens: int = 200_000, index: IndexConfig | None = None) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self.index_config = index or IndexConfig()
        self.stats = StoreStats()
        self.tokens = 0  # tokens held over all tenants (never above max_tokens)
        self._tenants: dict[Hashable, SuffixIndex] = {}
        self._age: deque[Hashable] = deque()  # the tenant of every stored document, oldest first
        self._lock = threading.Lock()

    @property
    def entries(self) -> int:
        """Positions held over all tenants' n-grams (at most max_ngram per stored token)."""
        with self._lock:
            return sum(ix.entries for ix in self._tenants.values())

    def tenants(self) -> list[Hashable]:
        """The tenants holding text now."""
        with self._lock:
            return list(self._tenants)

    def add(self, tokens: list[int], tenant: Hashable = None) -> None:
        """Keep `tokens` (a finished answer) for later requests of `tenant`; evict the oldest
        documents while over the budget. A document longer than the budget keeps its last tokens."""
        self.open(list(tokens)[-self.max_tokens :] if self.max_tokens else [], tenant)

    def open(self, tokens: list[int], tenant: Hashable = None) -> "Written | None":
        """A new document of `tenant` holding `tokens` (an answer's head; `extend` appends what is
        written after it), the newest; None when the store keeps nothing or `tokens` is empty."""
        if not self.max_tokens or not tokens:
            return None
        with self._lock:
            index = self._tenants.get(tenant)
            if index is None:
                index = self._tenants[tenant] = SuffixIndex(self.index_config)
            written = Written(tenant, index, index.add([]))
            self._age.append(tenant)
            self.stats.added_docs += 1
            self._extend(written, list(tokens))
            return written

    def extend(self, written: "Written", tokens: list[int]) -> bool:
        """Append `tokens` to an open document; False once it has been evicted (the oldest first)."""
        with self._lock:
            return self._extend(written, list(tokens))

    def _extend(self, written: "Written", tokens: list[int]) -> bool:
        if self._tenants.get(written.tenant) is not written.index or not written.index.extend(written.doc, tokens):
            return False
        self.tokens += len(tokens)
        self.stats.added_tokens += len(tokens)
        while self.tokens > self.max_tokens:
            self.tokens -= self._evict()
        return True

    def _evict(self) -> int:
        tenant = self._age.popleft()
        index = self._tenants[tenant]
        n = index.evict_oldest()
        if not index.docs:
            del self._tenants[tenant]  # no empty index per tenant seen once
        self.stats.evicted_tokens += n
        self.stats.evicted_docs += 1
        return n

    def match(self, context: list[int], tenant: Hashable = None) -> Match:
        """`tenant`'s longest match of `context` (an empty Match when the tenant holds nothing)."""
        with self._lock:
            index = self._tenants.get(tenant)
            return Match() if index is None else index.match(context)

    def tree(self, context: list[int], tenant: Hashable, depth: int, budget: int, limits: "DraftLimits",
             top_k: int | None = None, own: "Written | None" = None) -> tuple[DraftTree, int]:
        """`tenant`'s draft tree after `context` (`suffix_tree`; its last token is the root; the
        document `own` not read), under the lock (documents may be evicted meanwhile), and the match
        length it came from."""
        with self._lock:
            index = self._tenants.get(tenant)
            if index is None:
                return DraftTree.root_only(context[-1]), 0
            exclude = own.doc if own is not None and own.index is index else None
            return suffix_tree(index, context, depth, budget, limits, top_k, exclude)


@dataclass(frozen=True)
class DraftLimits:
    """How much a match may draft (SuffixDecoding's knobs). A tree keeps at most
    min(budget, spec_factor * match length + spec_offset) nodes (a longer match earns a longer
    draft), each observed after at least `min_prob` of the match's occurrences."""

    min_prob: float = 0.1
    spec_factor: float = 1.0
    spec_offset: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_prob <= 1.0 or self.spec_factor < 0:
            raise ValueError(f"need 0 <= min_prob <= 1 and spec_factor >= 0, got {self}")

    def nodes(self, match_length: int, budget: int) -> int:
        return min(budget, int(self.spec_factor * match_length + self.spec_offset)) if match_length else 0


def suffix_tree(index: SuffixIndex, context: list[int], depth: int, budget: int, limits: DraftLimits,
                top_k: int | None = None, exclude: int | None = None) -> tuple[DraftTree, int]:
    """The frequency tree (`frequency_tree`) after the longest match of `context` (whose last
    token, the root, is the tree's root) in `index` (document `exclude` not read), within `depth`
    levels and `limits`; and the match length (0: nothing matched)."""
    match = index.match(context, exclude)
    nodes = limits.nodes(match.length, budget)
    if nodes <= 0 or depth <= 0:
        return DraftTree.root_only(context[-1]), match.length
    return frequency_tree(context[-1], match.continuations(index, depth), nodes, limits.min_prob, top_k), match.length


__all__ = ["DraftLimits", "IndexConfig", "Match", "StoreStats", "SuffixIndex", "SuffixStore", "Written", "frequency_tree", "suffix_tree"]
