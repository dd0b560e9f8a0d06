"""Routing parts for KV pressure and their baselines: the index's eviction prediction, the
eviction scorer, the consistent-hash baseline, and Zipf tenant popularity in the workload."""

from __future__ import annotations

from collections import Counter

import msgspec

from yieldgate.cache import PrefixIndex, RouteRequest, Router
from yieldgate.cache.scorers import ConsistentHashScorer, EvictionScorer, RouteContext, rendezvous
from yieldgate.loadtest import SharedPrefixWorkload


class Replica(msgspec.Struct):
    name: str
    inflight: int = 0
    num_waiting: float = 0
    num_running: float = 0
    kv_capacity_blocks: int | None = None


def test_eviction_victims_are_the_lru_head_past_capacity_skipping_the_requests_own_blocks() -> None:
    index = PrefixIndex()
    index.set_capacity("a", 6)
    index.record("a", [1, 2, 3])
    index.record("a", [4, 5])  # LRU oldest first: 3, 2, 1, 5, 4 (a request's tail is touched first)
    assert index.blocks("a") == [3, 2, 1, 5, 4]
    assert index.eviction_victims("a", 1) == []  # one free block: nothing goes
    assert index.eviction_victims("a", 3) == [3, 2]
    assert index.eviction_victims("a", 3, keep={3}) == [2, 1]  # a block the request touches stays
    assert index.eviction_victims("b", 5) == []  # an unknown replica holds nothing to lose


def _ctx(index: PrefixIndex, hashes: list[int], names: list[str]) -> RouteContext:
    return RouteContext(request=RouteRequest(block_hashes=hashes), block_hashes=hashes, block_size=32,
                        matches=index.match(hashes), loads={n: 0.0 for n in names}, index=index)


def test_the_eviction_scorer_counts_victims_no_other_replica_holds() -> None:
    """Both caches are full; a cold 3-block request would evict 3 blocks on either replica, but
    a's oldest blocks exist only on a, while b's oldest are also on a: only a loses hits."""
    index = PrefixIndex()
    for name in ("a", "b"):
        index.set_capacity(name, 6)
    index.record("a", [10, 11, 12])
    index.record("a", [20, 21, 22])
    index.record("b", [20, 21, 22])
    index.record("b", [30, 31, 32])
    replicas = [Replica("a"), Replica("b")]
    scores = EvictionScorer().score(_ctx(index, [90, 91, 92], ["a", "b"]), replicas)
    assert scores == {"a": -3.0, "b": 0.0}
    # A request whose prefix a holds needs one new block on a, evicting 22 (b has it too), and
    # four on b, evicting 22, 21, 20 (on a too) and 32 (only on b).
    scores = EvictionScorer().score(_ctx(index, [10, 11, 12, 93], ["a", "b"]), replicas)
    assert scores == {"a": 0.0, "b": -1.0}
    # With room to spare nothing is evicted anywhere.
    index.set_capacity("a", 100)
    index.set_capacity("b", 100)
    assert EvictionScorer().score(_ctx(index, [90, 91, 92], ["a", "b"]), replicas) == {"a": 0.0, "b": 0.0}


def test_cache_aware_evict_sends_a_cold_prefix_where_it_destroys_nothing_unique() -> None:
    index = PrefixIndex()
    replicas = [Replica("a", kv_capacity_blocks=6), Replica("b", kv_capacity_blocks=6)]
    index.set_capacity("a", 6)
    index.set_capacity("b", 6)
    index.record("a", [10, 11, 12])
    index.record("a", [20, 21, 22])
    index.record("b", [20, 21, 22])
    index.record("b", [30, 31, 32])
    # Whichever replica the tie-break would favour, the new prefix must go to b (a fresh router
    # each time: its recent picks would otherwise start balancing).
    for first in range(90, 110):
        request = RouteRequest(block_hashes=[first, first + 1000, first + 2000])
        assert Router("cache_aware_evict", index).pick(request, replicas).replica.name == "b"


def test_consistent_hash_sends_a_prefix_home_however_loaded_home_is() -> None:
    replicas = [Replica(f"r{i}") for i in range(4)]
    router = Router("consistent_hash", PrefixIndex())
    homes = set()
    for first in range(40):
        home = max(replicas, key=lambda c: rendezvous(str(first), c.name))
        home.inflight = 50  # a loaded home still gets its prefix
        picked = router.pick(RouteRequest(block_hashes=[first, 7, 8]), replicas).replica
        assert picked is home
        home.inflight = 0
        homes.add(home.name)
    assert len(homes) == 4  # different prefixes spread over the fleet
    assert ConsistentHashScorer().score(_ctx(PrefixIndex(), [], ["r0"]), replicas[:1]) == {"r0": 0.0}


def test_zipf_tenant_popularity_makes_a_few_tenants_hot_and_zero_keeps_the_uniform_stream() -> None:
    def tenants(w: SharedPrefixWorkload, n: int = 3000) -> Counter:
        return Counter(s.group for s in w.take(n))

    zipf = tenants(SharedPrefixWorkload(tenants=100, prefix_tokens=8, tenant_zipf=1.0))
    uniform = tenants(SharedPrefixWorkload(tenants=100, prefix_tokens=8))
    assert zipf["tenant-0"] > 5 * zipf["tenant-50"]  # Zipf(1): tenant 1 about 50x tenant 51
    assert zipf.most_common(1)[0][0] == "tenant-0"
    assert max(uniform.values()) < 3 * min(uniform.values())
    # tenant_zipf=0 is the default stream, draw for draw.
    same = SharedPrefixWorkload(tenants=100, prefix_tokens=8, tenant_zipf=0.0).take(50)
    assert [s.group for s in same] == [s.group for s in SharedPrefixWorkload(tenants=100, prefix_tokens=8).take(50)]


def test_the_index_counts_each_blocks_holders_through_every_way_a_block_leaves() -> None:
    index = PrefixIndex()
    index.set_capacity("a", 3)
    index.record("a", [1, 2])
    index.store("b", [2, 3])
    assert [index.holders(h) for h in (1, 2, 3, 4)] == [1, 2, 1, 0]
    index.record("a", [5, 6, 7])  # a's capacity 3 evicts 2 and 1 (b still holds 2)
    assert [index.holders(h) for h in (1, 2, 5)] == [0, 1, 1]
    index.remove("b", [2])
    assert index.holders(2) == 0
    index.clear("b")
    assert index.holders(3) == 0
    index.record("a", [5])  # touching a held block is not a second holder
    assert index.holders(5) == 1
