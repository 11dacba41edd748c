"""Block pool and prefix cache: exact block ids, free-queue order, ref counts, hashing."""

import pytest

from engine.block_pool import NULL_BLOCK, BlockPool, KVCacheManager, chain_hash
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def make_seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, str(seq_id), tokens, SamplingParams(max_tokens=4))


def test_fresh_pool_hands_out_blocks_in_id_order_and_never_the_null_block():
    pool = BlockPool(6)
    assert pool.num_free_blocks == 5
    assert pool.allocate(3) == [1, 2, 3]
    assert NULL_BLOCK not in pool.free_queue
    assert pool.allocate(2) == [4, 5]
    with pytest.raises(RuntimeError):
        pool.allocate(1)


def test_freed_blocks_join_the_back_of_the_free_queue_in_free_order():
    pool = BlockPool(6)
    first = pool.allocate(3)  # 1, 2, 3
    pool.free([3, 1])
    assert list(pool.free_queue) == [4, 5, 3, 1]
    assert pool.allocate(4) == [4, 5, 3, 1]
    assert pool.ref_counts[first[1]] == 1


def test_ref_counts_keep_shared_blocks_out_of_the_free_queue():
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    pool.touch([block])
    pool.free([block])
    assert block not in pool.free_queue and pool.ref_counts[block] == 1
    pool.free([block])
    assert block in pool.free_queue and pool.ref_counts[block] == 0
    with pytest.raises(RuntimeError):
        pool.free([block])


def test_eviction_takes_the_least_recently_freed_cached_block_first():
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    for block, h in ((a, 10), (b, 20), (c, 30)):
        pool.register(block, h)
    pool.free([b])
    pool.free([a])
    pool.free([c])
    assert pool.allocate(1) == [b]  # least recently freed goes first
    assert pool.lookup(20) is None
    assert pool.lookup(10) == a and pool.lookup(30) == c
    pool.touch([c])  # a hit revives c; a is now the only evictable block
    assert pool.allocate(1) == [a]
    assert pool.lookup(10) is None and pool.lookup(30) == c


def test_chain_hash_depends_on_parent_and_tokens():
    h1 = chain_hash(None, [1, 2])
    assert chain_hash(None, [1, 2]) == h1
    assert chain_hash(h1, [3, 4]) != chain_hash(None, [3, 4])
    assert chain_hash(None, [1, 3]) != h1


def test_chain_hash_is_a_sha256_digest_and_folds_in_the_extra_key():
    h = chain_hash(None, [1, 2])
    assert isinstance(h, bytes) and len(h) == 32
    assert chain_hash(None, [1, 2], "tenant-a") not in (h, chain_hash(None, [1, 2], "tenant-b"))
    assert chain_hash(None, [1, 2, 3]) != chain_hash(None, [1, 2]) != chain_hash(None, [2**40 + 1, 2])


def test_requests_share_blocks_only_with_the_same_cache_salt():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    tokens = list(range(9))
    first = make_seq(0, tokens)
    first.cache_salt = "tenant-a"
    kv.admit(first, kv.find_cached_prefix(first))
    kv.allocate_slots(first, 9)
    for salt, hits in ((None, 0), ("tenant-b", 0), ("tenant-a", 2)):
        other = make_seq(1, tokens)
        other.cache_salt = salt
        assert len(kv.find_cached_prefix(other)) == hits


def test_hit_and_query_counters_count_a_first_admission_only():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    seq = make_seq(0, list(range(9)))
    kv.admit(seq, kv.find_cached_prefix(seq))
    seq.num_cached_tokens = 0  # what the scheduler records at the first admission
    kv.allocate_slots(seq, 9)
    kv.free(seq)  # preempted
    kv.admit(seq, kv.find_cached_prefix(seq))  # re-admitted with its own blocks as hits
    assert seq.num_computed_tokens == 8
    assert kv.stats.queries == 9 and kv.stats.hits == 0


def test_prefix_hits_are_counted_in_whole_blocks_and_leave_one_token_to_compute():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = make_seq(0, list(range(10)))  # 2 full blocks + 2 tokens
    kv.admit(first, kv.find_cached_prefix(first))
    assert kv.allocate_slots(first, 10)
    assert first.block_table == [1, 2, 3]
    assert first.num_registered_blocks == 2

    second = make_seq(1, list(range(8)) + [99, 98, 97])
    hits = kv.find_cached_prefix(second)
    assert hits == [1, 2]
    kv.admit(second, hits)
    assert second.num_computed_tokens == 8
    assert kv.stats.hits == 8 and kv.stats.queries == 10 + 11

    exact = make_seq(2, list(range(8)))  # fully cached prompt: the last block is recomputed
    assert kv.find_cached_prefix(exact) == [1]


def test_a_one_token_change_in_block_k_misses_from_block_k_on():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    base = make_seq(0, list(range(17)))
    kv.admit(base, [])
    kv.allocate_slots(base, 17)
    for k in range(4):
        tokens = list(range(17))
        tokens[4 * k + 1] = 1000
        assert len(kv.find_cached_prefix(make_seq(10 + k, tokens))) == k


def test_all_blocks_return_to_the_pool_after_sequences_finish():
    kv = KVCacheManager(num_blocks=12, block_size=4)
    seqs = [make_seq(i, [7, 7, 7, 7, 7, 7, 7, 7, i]) for i in range(3)]
    for seq in seqs:
        kv.admit(seq, kv.find_cached_prefix(seq))
        assert kv.allocate_slots(seq, seq.num_tokens - seq.num_computed_tokens)
    assert seqs[1].block_table[:2] == seqs[0].block_table[:2]  # shared prefix blocks
    assert kv.pool.ref_counts[seqs[0].block_table[0]] == 3
    for seq in seqs:
        kv.free(seq)
    assert kv.pool.num_free_blocks == 11
    assert all(count == 0 for count in kv.pool.ref_counts)


def test_caching_off_never_hits():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    a = make_seq(0, list(range(9)))
    kv.admit(a, kv.find_cached_prefix(a))
    kv.allocate_slots(a, 9)
    assert kv.find_cached_prefix(make_seq(1, list(range(9)))) == []
    assert kv.pool.cached == {}


def test_copy_on_write_copies_exactly_the_shared_partial_block():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    parent = make_seq(0, list(range(6)))  # one full block + a partial one
    kv.admit(parent, [])
    assert kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    parent.append_token(100)
    child = parent.fork(1, sample_index=1)
    child.token_ids[-1] = 200
    kv.share_blocks(child)
    assert child.block_table == parent.block_table == [1, 2]
    assert kv.pool.ref_counts[1] == 2 and kv.pool.ref_counts[2] == 2

    assert kv.allocate_slots(parent, 1)  # parent writes position 6, inside the shared partial block
    assert kv.take_copies() == [(2, 3)]
    assert parent.block_table == [1, 3] and kv.pool.ref_counts[2] == 1
    assert kv.allocate_slots(child, 1)  # the child now holds block 2 alone: no copy
    assert kv.take_copies() == [] and child.block_table == [1, 2]
    assert kv.pool.ref_counts[1] == 2  # the full block stays shared
    kv.free(parent)
    kv.free(child)
    assert all(count == 0 for count in kv.pool.ref_counts) and kv.pool.num_free_blocks == 15


def test_copy_on_write_waits_when_no_block_is_free():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    parent = make_seq(0, [1, 2, 3, 4, 5])
    kv.admit(parent, [])
    kv.allocate_slots(parent, 5)
    parent.num_computed_tokens = 5
    child = parent.fork(1, 1)
    kv.share_blocks(child)
    assert kv.pool.num_free_blocks == 0
    assert not kv.allocate_slots(parent, 1)
    assert kv.take_copies() == [] and parent.block_table == [1, 2]
