"""Paged KV block accounting: allocation, freeing, prefix caching and per-tier usage.

Block ``i`` of a sequence's ``block_table`` holds positions
``[i*block_size, (i+1)*block_size)``. A block that is full and computed is
registered in the prefix cache under a hash chained over (parent hash, its
token ids, the sequence's adapter): a LoRA adapter changes keys and values, so
the same tokens under another adapter are another block. With
``scope_by_tenant`` the chain starts from the sequence's tenant, so one
tenant never hits another's blocks: a hit shows in ``cached_tokens`` and in
time to first token, which would tell a tenant what others have sent. For a
model with a long-context regime (``long_context_after``: Phi-3's LongRoPE
rotates keys otherwise there) the chain of a sequence in that regime starts
from another root, so a block is only ever hit in the regime that computed it.
Blocks with no
reference are free; a free block keeps its hash (and can be hit again) until it
is reused, least recently freed first.

Per-tier usage: a block counts once for every tier that has at least one live
sequence referencing it, so a block shared by premium and standard counts for
both. This over-counts shared blocks on purpose: a tier's usage then changes
only through its own sequences' allocations and frees, so a cap checked at
allocation time can never be exceeded later by another tier releasing a shared
block, which makes the reserve check sound.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from scheduler.sequence import Sequence


@dataclass(frozen=True)
class TierCap:
    """The tiers in ``tiers`` together may hold at most ``limit`` blocks."""

    limit: int
    tiers: frozenset[str]


@dataclass
class _Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    tier_refs: Counter = field(default_factory=Counter)


def _chain_hash(parent: bytes, token_ids: list[int], adapter: str | None) -> bytes:
    # sha256 rather than Python's hash(): tenants choose the tokens, and a
    # crafted collision would hand one tenant another tenant's keys and values.
    h = hashlib.sha256(parent)
    if adapter is None:
        h.update(b"\x00")
    else:
        name = adapter.encode()
        h.update(b"\x01" + len(name).to_bytes(4, "little") + name)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        caps: tuple[TierCap, ...] = (),
        scope_by_tenant: bool = True,
        long_context_after: int | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.caps = caps
        self.scope_by_tenant = scope_by_tenant
        self.long_context_after = long_context_after
        self._blocks = [_Block(i) for i in range(num_blocks)]
        # Insertion order is the reuse order: least recently freed first.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self._tier_used: Counter = Counter()
        # Hash chain of each live sequence's full blocks; tokens only ever get
        # appended, so the chain stays valid across preemptions.
        self._hashes: dict[str, list[bytes]] = {}
        # How many leading blocks of each sequence's table register_computed has seen.
        self._registered: dict[str, int] = {}

    # -- queries -------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def used_by_tier(self) -> dict[str, int]:
        return {tier: n for tier, n in self._tier_used.items() if n}

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cap_for(self, tier: str) -> int:
        """The most blocks a sequence of ``tier`` could ever hold alone."""
        return min([c.limit for c in self.caps if tier in c.tiers], default=self.num_blocks)

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of ``seq``'s tokens.

        Stops short of the last token: the step that computes it produces the
        logits the sequence samples from.
        """
        if not self.enable_prefix_caching or not seq.reads_prefix_cache:
            return []
        num_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(seq, num_blocks)
        hits = []
        for h in hashes[:num_blocks]:
            block_id = self._cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def can_allocate(self, seq: Sequence, num_tokens: int, cached: list[int] = (), spare: int = 0) -> bool:
        """Could ``seq`` take ``cached`` and then cover positions ``[0, num_tokens)``, leaving ``spare``
        blocks free?"""
        new = self.blocks_for(num_tokens) - len(seq.block_table) - len(cached)
        if new <= 0 and not cached:
            return True
        new = max(new, 0)
        revived = sum(1 for b in cached if self._blocks[b].ref_count == 0)
        if new + revived + spare > len(self._free):
            return False
        added = new + sum(1 for b in cached if self._blocks[b].tier_refs[seq.tier] == 0)
        for cap in self.caps:
            if seq.tier in cap.tiers and added:
                if sum(self._tier_used[t] for t in cap.tiers) + added > cap.limit:
                    return False
        return True

    # -- changes -------------------------------------------------------------

    def allocate(self, seq: Sequence, num_tokens: int, cached: list[int] = ()) -> None:
        """Take the cached prefix blocks, then fresh blocks up to ``num_tokens`` positions."""
        if cached and seq.block_table:
            raise ValueError("cached prefix blocks can only start an empty block table")
        if not self.can_allocate(seq, num_tokens, cached):
            raise RuntimeError(f"not enough KV blocks for sequence {seq.seq_id}")
        for block_id in cached:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            self._acquire(block, seq.tier)
            seq.block_table.append(block_id)
        while len(seq.block_table) < self.blocks_for(num_tokens):
            block_id, _ = self._free.popitem(last=False)
            block = self._blocks[block_id]
            if block.hash is not None:
                # Reusing a cached block: its old contents are gone.
                del self._cached[block.hash]
                block.hash = None
            self._acquire(block, seq.tier)
            seq.block_table.append(block_id)

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks; cached ones stay hit-able until reused."""
        # Tail first, so the head of a shared prefix outlives its tails in the LRU.
        for block_id in reversed(seq.block_table):
            self._release(self._blocks[block_id], seq.tier)
        seq.block_table = []
        self._registered.pop(seq.seq_id, None)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks of ``seq`` past those that positions ``[0, num_tokens)`` need: taken for
        drafted positions a step rejected (speculative decoding). Never registered: past its computed tokens."""
        keep = self.blocks_for(num_tokens)
        if keep < self._registered.get(seq.seq_id, 0):
            raise ValueError(f"sequence {seq.seq_id} cannot give back blocks the prefix cache holds")
        for block_id in reversed(seq.block_table[keep:]):
            self._release(self._blocks[block_id], seq.tier)
        del seq.block_table[keep:]

    def forget(self, seq: Sequence) -> None:
        """Drop what is kept about a sequence that is gone (finished or aborted)."""
        self.free(seq)
        self._hashes.pop(seq.seq_id, None)

    def restart(self, seq: Sequence) -> int:
        """``seq`` crossed into the long-context regime: drop its blocks and its chain (rooted in the
        short regime), take what the cache holds of it in the new one; returns the positions covered."""
        self.forget(seq)
        cached = self.match_prefix(seq)
        if not cached or not self.can_allocate(seq, len(cached) * self.block_size, cached):
            return 0
        self.allocate(seq, len(cached) * self.block_size, cached)
        return len(cached) * self.block_size

    def register_computed(self, seq: Sequence) -> None:
        """Enter ``seq``'s full, computed blocks into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        done = self._registered.get(seq.seq_id, 0)
        if num_full <= done:
            return
        hashes = self._block_hashes(seq, num_full)
        for i in range(done, num_full):
            block = self._blocks[seq.block_table[i]]
            if block.hash is None and hashes[i] not in self._cached:
                block.hash = hashes[i]
                self._cached[hashes[i]] = block.block_id
        self._registered[seq.seq_id] = num_full

    def reclaimable(self, seqs: list[Sequence]) -> int:
        """Blocks that would become free if all of ``seqs`` were preempted."""
        refs = Counter(b for s in seqs for b in s.block_table)
        return sum(1 for b, n in refs.items() if self._blocks[b].ref_count == n)

    # -- internals -----------------------------------------------------------

    def _acquire(self, block: _Block, tier: str) -> None:
        block.ref_count += 1
        if block.tier_refs[tier] == 0:
            self._tier_used[tier] += 1
        block.tier_refs[tier] += 1

    def _release(self, block: _Block, tier: str) -> None:
        block.ref_count -= 1
        block.tier_refs[tier] -= 1
        if block.tier_refs[tier] == 0:
            del block.tier_refs[tier]
            self._tier_used[tier] -= 1
        if block.ref_count == 0:
            self._free[block.block_id] = None

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The chain of ``seq``'s first ``num_blocks`` full blocks (or more: it is cached)."""
        hashes = self._hashes.setdefault(seq.seq_id, [])
        tokens = None
        while len(hashes) < num_blocks:
            if tokens is None:
                tokens = seq.all_token_ids
            i = len(hashes)
            parent = hashes[-1] if hashes else self._chain_root(seq)
            hashes.append(_chain_hash(parent, tokens[i * self.block_size : (i + 1) * self.block_size], seq.adapter))
        return hashes

    def _chain_root(self, seq: Sequence) -> bytes:
        root = b""
        if self.scope_by_tenant and seq.tenant is not None:
            root = hashlib.sha256(b"tenant\x00" + seq.tenant.encode("utf-8", "surrogatepass")).digest()
        if seq.is_long_context(self.long_context_after):
            root = hashlib.sha256(b"long-context\x00" + root).digest()
        return root

    def check_invariants(self, live: list[Sequence]) -> None:
        """Raise AssertionError if the books do not balance against ``live`` sequences."""
        refs: Counter = Counter()
        tier_refs: dict[int, Counter] = {}
        for seq in live:
            assert len(set(seq.block_table)) == len(seq.block_table), f"{seq.seq_id} holds a block twice"
            for b in seq.block_table:
                refs[b] += 1
                tier_refs.setdefault(b, Counter())[seq.tier] += 1
        for block in self._blocks:
            assert block.ref_count == refs[block.block_id], f"block {block.block_id} ref_count {block.ref_count}"
            assert (block.ref_count == 0) == (block.block_id in self._free), f"block {block.block_id} free list"
            assert +block.tier_refs == tier_refs.get(block.block_id, Counter()), f"block {block.block_id} tiers"
            if block.hash is not None:
                assert self._cached.get(block.hash) == block.block_id, f"block {block.block_id} hash"
        assert len(self._cached) == sum(1 for b in self._blocks if b.hash is not None)
        used: Counter = Counter()
        for counter in tier_refs.values():
            for tier in counter:
                used[tier] += 1
        assert +self._tier_used == used, f"tier usage {dict(self._tier_used)} != {dict(used)}"
        for cap in self.caps:
            held = sum(used[t] for t in cap.tiers)
            assert held <= cap.limit, f"tiers {sorted(cap.tiers)} hold {held} > cap {cap.limit}"
