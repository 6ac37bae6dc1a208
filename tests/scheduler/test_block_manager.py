"""Paged block allocation, freeing, prefix caching with reference counts, LRU reuse, tier caps."""

from __future__ import annotations

import pytest

from scheduler.block_manager import BlockManager, TierCap


def computed(bm: BlockManager, seq, num_tokens: int) -> None:
    """Allocate and mark ``num_tokens`` positions computed, as a step would."""
    bm.allocate(seq, num_tokens)
    seq.num_computed_tokens = num_tokens
    bm.register_computed(seq)


def test_allocation_covers_positions_in_whole_blocks(seq):
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(10)
    bm.allocate(s, 9)
    assert len(s.block_table) == 3
    assert bm.num_free_blocks == 5
    bm.allocate(s, 12)  # still inside the third block
    assert len(s.block_table) == 3
    bm.allocate(s, 13)
    assert len(s.block_table) == 4
    bm.check_invariants([s])


def test_free_returns_every_block(seq):
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = seq(10), seq(6)
    bm.allocate(a, 10)
    bm.allocate(b, 6)
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 6
    bm.check_invariants([b])
    bm.forget(b)
    assert bm.num_free_blocks == 8
    bm.check_invariants([])


def test_allocation_beyond_the_pool_is_refused_without_change(seq):
    bm = BlockManager(num_blocks=2, block_size=4)
    s = seq(12)
    assert not bm.can_allocate(s, 12)
    with pytest.raises(RuntimeError):
        bm.allocate(s, 12)
    assert s.block_table == [] and bm.num_free_blocks == 2


def test_prefix_hit_shares_full_blocks_with_reference_counts(seq):
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(10))
    a = seq(prompt)
    computed(bm, a, 10)
    b = seq(prompt[:9] + [99])
    hits = bm.match_prefix(b)
    assert hits == a.block_table[:2]  # two full blocks; the third is partial
    bm.allocate(b, 10, hits)
    assert [bm.ref_count(x) for x in hits] == [2, 2]
    assert b.block_table[2] != a.block_table[2]
    bm.check_invariants([a, b])


def test_prefix_match_leaves_the_last_token_to_compute(seq):
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(list(range(8)))
    computed(bm, a, 8)
    b = seq(list(range(8)))
    assert bm.match_prefix(b) == a.block_table[:1]


def test_blocks_enter_the_cache_only_when_full_and_computed(seq):
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(list(range(10)))
    bm.allocate(a, 10)
    a.num_computed_tokens = 3
    bm.register_computed(a)
    assert bm.num_cached_blocks == 0
    a.num_computed_tokens = 10
    bm.register_computed(a)
    assert bm.num_cached_blocks == 2


def test_adapter_is_part_of_the_block_hash(seq):
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(list(range(10)), adapter="sql")
    computed(bm, a, 10)
    assert bm.match_prefix(seq(list(range(10)), adapter="chat")) == []
    assert bm.match_prefix(seq(list(range(10)))) == []
    assert len(bm.match_prefix(seq(list(range(10)), adapter="sql"))) == 2


def test_freed_cached_blocks_count_as_free_and_can_still_be_hit(seq):
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq(list(range(9)))
    computed(bm, a, 9)
    bm.forget(a)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    b = seq(list(range(9)))
    hits = bm.match_prefix(b)
    assert len(hits) == 2
    bm.allocate(b, 9, hits)
    assert bm.num_free_blocks == 1
    bm.check_invariants([b])


def test_reuse_takes_the_least_recently_freed_block_and_drops_its_hash(seq):
    bm = BlockManager(num_blocks=4, block_size=4)
    old, new = seq(list(range(5))), seq(list(range(100, 105)))
    computed(bm, old, 5)
    bm.forget(old)
    computed(bm, new, 5)
    bm.forget(new)
    # Reuse order is least recently freed first: old's blocks, then new's tail; new's head survives.
    filler = seq(16)
    bm.allocate(filler, 12)
    assert bm.match_prefix(seq(list(range(5)))) == []  # old's block was reused
    assert len(bm.match_prefix(seq(list(range(100, 105))))) == 1  # new's survives
    bm.check_invariants([filler])


def test_shared_block_counts_for_every_tier_that_uses_it(seq):
    bm = BlockManager(num_blocks=8, block_size=4)
    p = seq(list(range(9)), tier="premium")
    computed(bm, p, 9)
    s = seq(list(range(9)), tier="standard")
    bm.allocate(s, 9, bm.match_prefix(s))
    assert bm.used_by_tier() == {"premium": 3, "standard": 3}
    assert bm.num_used_blocks == 4
    bm.forget(p)
    assert bm.used_by_tier() == {"standard": 3}  # premium leaving does not raise standard's count
    bm.check_invariants([s])


def test_tier_cap_refuses_blocks_past_the_limit_even_when_pool_has_room(seq):
    bm = BlockManager(num_blocks=10, block_size=4, caps=(TierCap(7, frozenset({"standard"})),))
    s = seq(40)
    assert bm.can_allocate(s, 28)
    assert not bm.can_allocate(s, 29)
    p = seq(40, tier="premium")
    assert bm.can_allocate(p, 40)
    assert bm.cap_for("standard") == 7 and bm.cap_for("premium") == 10


def test_taking_a_premium_cached_block_counts_against_the_standard_cap(seq):
    bm = BlockManager(num_blocks=10, block_size=4, caps=(TierCap(2, frozenset({"standard"})),))
    p = seq(list(range(13)), tier="premium")
    computed(bm, p, 13)
    s = seq(list(range(13)), tier="standard")
    hits = bm.match_prefix(s)
    assert len(hits) == 3
    assert not bm.can_allocate(s, 13, hits)  # 3 shared blocks + 1 new > 2
    assert bm.can_allocate(s, 8, hits[:2])


def test_reclaimable_counts_only_blocks_no_one_else_holds(seq):
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(list(range(9)))
    computed(bm, a, 9)
    b = seq(list(range(9)))
    bm.allocate(b, 9, bm.match_prefix(b))
    assert bm.reclaimable([b]) == 1  # its own last block; the two shared stay
    assert bm.reclaimable([a, b]) == 4


def test_prefix_caching_off_never_hits(seq):
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = seq(list(range(9)))
    computed(bm, a, 9)
    assert bm.match_prefix(seq(list(range(9)))) == [] and bm.num_cached_blocks == 0


def test_invariant_check_catches_a_block_held_twice_or_leaked(seq):
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq(8)
    bm.allocate(a, 8)
    a.block_table.append(a.block_table[0])
    with pytest.raises(AssertionError, match="twice"):
        bm.check_invariants([a])
    a.block_table.pop()
    with pytest.raises(AssertionError, match="ref_count"):
        bm.check_invariants([])  # a's blocks are referenced but a is not live: a leak
