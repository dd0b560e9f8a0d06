"""Routing policies, the prefix index's LRU model, Redis sharing and KV-event resync."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import pickle
import uuid

import msgspec
import pytest
import redis.asyncio as aioredis
import zmq
import zmq.asyncio

from yieldgate.cache import (
    BlockHasher, KVEventSubscriber, PrefixIndex, PrefixIndexConfig, RouteRequest, Router, RouterConfig,
    SharedPrefixIndex, UnknownPolicy, lora_extra_keys,
)
from yieldgate.cache.scorers import HotspotFilter, KVCostScorer, RouteContext, ShareFilter


class Replica(msgspec.Struct):
    name: str
    inflight: int = 0
    num_waiting: float = 0
    num_running: float = 0
    kv_capacity_blocks: int | None = None
    speculative: bool = False


def tokens(prefix: int, n_blocks: int, suffix: int = 0) -> list[int]:
    """`n_blocks` full blocks of a tenant prefix, then a per-user suffix."""
    return [(prefix * 7919 + i) % 1000 + 4 for i in range(32 * n_blocks)] + [5 + suffix] * 10


def engine_chain(token_ids: list[int], seed: str = "0", extra: tuple | None = None) -> list[int]:
    """vLLM's chained block hashes, written out: SHA-256 of the pickled (parent, block, extra keys)."""
    def h(obj: object) -> bytes:
        return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    parent, out = h(seed), []
    for start in range(0, len(token_ids) - 31, 32):
        parent = h((parent, tuple(token_ids[start:start + 32]), extra))
        out.append(int.from_bytes(parent, "big") & (2**64 - 1))
    return out


def test_block_hashes_are_the_engine_chain_for_any_ids_and_from_the_memo() -> None:
    """The memo's packed keys change nothing: first and repeated (memo-hit) hashing give the
    engine's chain, for ordinary ids and for ids too big to pack; its keys are not tracked."""
    hasher = BlockHasher()
    for ids in (tokens(1, 8, 3), [2**40 + i for i in range(100)], tokens(1, 8, 4)):
        assert hasher.hashes(ids) == engine_chain(ids)
        assert hasher.hashes(ids) == engine_chain(ids)
    assert not any(gc.is_tracked(k) for k in hasher._memo if isinstance(k, bytes))
    assert not any(gc.is_tracked(v) for v in hasher._memo.values())  # kept per new block: untracked
    assert sum(isinstance(k, bytes) for k in hasher._memo) >= 8


def test_spans_shared_between_prompts_give_the_engine_chain() -> None:
    """Prompts sharing a long prefix reuse whole spans of digests from the span memo; every prefix
    length, tail and LoRA salt still gives the engine's chain, and the memo's keys and values are
    bytes the garbage collector does not track."""
    from yieldgate.cache.blocks import _SPAN

    hasher = BlockHasher()
    base = tokens(3, 4 * _SPAN + 3)
    for cut in (0, 31, 32, 32 * _SPAN - 1, 32 * _SPAN, 32 * _SPAN + 40, 32 * 3 * _SPAN + 5, len(base)):
        for tail in (1, 2):
            ids = base[:cut] + [9 + tail] * 70
            assert hasher.hashes(ids) == engine_chain(ids)
    assert len(hasher._spans) >= 4
    assert not any(gc.is_tracked(k) or gc.is_tracked(v) for k, v in hasher._spans.items())
    lora = lora_extra_keys("ad", "/adapters/ad")
    for _ in range(2):  # computed, then from the spans
        assert hasher.hashes(base, extra_keys=lora) == engine_chain(base, extra=lora) != engine_chain(base)


def test_a_full_memo_drops_its_oldest_blocks_and_still_hashes_the_engine_chain(monkeypatch) -> None:
    from yieldgate import cache
    monkeypatch.setattr(cache.blocks, "_MEMO_MAX_BLOCKS", 64)
    hasher = BlockHasher()
    prompts = [tokens(p, 8, 1) for p in range(20)]  # 160 distinct blocks through a 64-block memo
    for ids in prompts + prompts[:3]:
        assert hasher.hashes(ids) == engine_chain(ids)
        assert len(hasher._memo) <= 64
    newest = prompts[-1]
    assert hasher.hashes(newest) == engine_chain(newest)
    packed_last = cache.blocks.pack_tokens(newest[7 * 32:8 * 32])
    assert any(k.endswith(packed_last) for k in hasher._memo)  # the newest blocks stayed


def test_prefix_routed_twice_lands_on_same_replica() -> None:
    router = Router("cache_aware", PrefixIndex(), block_size=32)
    fleet = [Replica("a"), Replica("b"), Replica("c")]
    for prefix in range(6):
        first = router.pick(RouteRequest(token_ids=tokens(prefix, 8, 1)), fleet)
        router.sent(first)
        router.first_token(first)  # its first token is back
        second = router.pick(RouteRequest(token_ids=tokens(prefix, 8, 2)), fleet)
        assert second.replica.name == first.replica.name
        assert second.predicted_cached_tokens == 8 * 32


def test_cache_aware_spills_hot_prefix_from_loaded_replica() -> None:
    router = Router("cache_aware", PrefixIndex(), block_size=32)
    a, b = Replica("a"), Replica("b")
    first = router.pick(RouteRequest(token_ids=tokens(1, 8)), [a, b])
    router.sent(first)
    router.first_token(first)
    home = router.pick(RouteRequest(token_ids=tokens(1, 8)), [a, b]).replica.name
    other = "b" if home == "a" else "a"
    loaded = {home: Replica(home, inflight=12, num_running=12), other: Replica(other)}
    d = router.pick(RouteRequest(token_ids=tokens(1, 8)), list(loaded.values()))
    assert d.replica.name == other and d.predicted_cached_tokens == 0
    # A mildly busier cache holder still wins: 8 cached blocks outweigh one queued request.
    loaded[home] = Replica(home, inflight=1)
    assert router.pick(RouteRequest(token_ids=tokens(1, 8)), list(loaded.values())).replica.name == home


@pytest.mark.parametrize("loads,dropped", [
    ((9, 3), {"a"}),          # two replicas: more than twice the other's load and 5+ ahead
    ((6, 0), {"a"}),
    ((8, 4), set()),          # twice the other's: kept
    ((5, 0), set()),          # only 5 ahead: kept
    ((6, 2, 2, 2), {"a"}),    # four: over the fleet's mean + 2.5 and over twice the others'
    ((5, 2, 2, 2), set()),
])
def test_hotspot_guard_compares_each_replica_with_the_others(loads, dropped) -> None:
    fleet = [Replica(name) for name in "abcd"[:len(loads)]]
    ctx = RouteContext(request=RouteRequest(), block_hashes=[], block_size=32, matches={},
                       loads={r.name: float(x) for r, x in zip(fleet, loads)})
    kept = {r.name for r in HotspotFilter().filter(ctx, fleet)}
    assert kept == {r.name for r in fleet} - dropped


def test_overlap_weight_defaults_to_more_on_small_fleets() -> None:
    def score(n: int, weight: float | None = None) -> float:
        fleet = [Replica(f"r{i}") for i in range(n)]
        ctx = RouteContext(request=RouteRequest(), block_hashes=[b"x"] * 9, block_size=32, matches={},
                           loads={r.name: 0.0 for r in fleet})
        return KVCostScorer(weight).score(ctx, fleet)["r0"]

    # 10 blocks to prefill (9 full + the partial last one), nothing else: the cost is the weight's.
    assert score(2) == -20.0 and score(4) == pytest.approx(-40 / 3) and score(65) == pytest.approx(-10 - 10 / 64)
    assert score(2, weight=1.0) == -10.0


def test_requests_arriving_together_split_while_the_first_prefill_is_pending() -> None:
    router = Router("cache_aware", PrefixIndex(), block_size=32)
    fleet = [Replica("a"), Replica("b")]
    by_name = {r.name: r for r in fleet}
    warm = router.pick(RouteRequest(token_ids=tokens(3, 8, 0)), fleet)
    router.sent(warm)
    router.first_token(warm)
    home = warm.replica.name
    # A long new request on the prefix's home: its 70 blocks of prefill are queued there...
    long_one = router.pick(RouteRequest(token_ids=tokens(3, 8, 0) + tokens(4, 70)), fleet)
    router.sent(long_one)
    by_name[home].inflight = 1
    assert long_one.replica.name == home and long_one.pending_blocks == 71
    # ...so a short request for the same prefix arriving meanwhile is cheaper on the idle replica.
    assert router.pick(RouteRequest(token_ids=tokens(3, 8, 1)), fleet).replica.name != home
    router.first_token(long_one)
    router.first_token(long_one)  # idempotent
    router.done(long_one)         # ...and so is the end
    assert router.pending.blocks[home] == 0
    by_name[home].inflight = 0
    assert router.pick(RouteRequest(token_ids=tokens(3, 8, 2)), fleet).replica.name == home


def test_pending_prefill_heals_when_nothing_is_in_flight() -> None:
    router = Router("cache_aware", PrefixIndex(), block_size=32)
    fleet = [Replica("a"), Replica("b")]
    d = router.pick(RouteRequest(token_ids=tokens(1, 10)), fleet)
    assert router.pending.blocks[d.replica.name] == 11  # a caller that never released...
    e = router.pick(RouteRequest(token_ids=tokens(2, 1)), fleet)
    # ...cannot leave phantom work on an idle replica: only the newest pick's blocks remain.
    assert router.pending.blocks[d.replica.name] == (e.pending_blocks if e.replica.name == d.replica.name else 0)


def test_hot_prefix_spreads_instead_of_piling_up() -> None:
    router = Router("cache_aware", PrefixIndex(), block_size=32)
    fleet = {n: Replica(n) for n in "abc"}
    for i in range(60):  # one hot tenant prefix, requests never finish
        d = router.pick(RouteRequest(token_ids=tokens(9, 8, i)), list(fleet.values()))
        router.sent(d)
        fleet[d.replica.name].inflight += 1
    loads = sorted(r.inflight for r in fleet.values())
    assert loads[-1] <= 1.5 * (60 / 3) + 2 + 1


def _shared_system_prompt_sessions(router: Router, fleet: list[Replica], sessions: int,
                                   system_blocks: int = 8) -> dict[str, int]:
    """Agent sessions on an idle fleet (nothing in flight): every session starts with the same
    system prompt (8 blocks), then 3 turns whose context (24+ blocks) is the session's own."""
    counts = {r.name: 0 for r in fleet}
    system = tokens(1, system_blocks)[: system_blocks * 32]
    for s in range(sessions):
        context = system + tokens(100 + s, 4)[: 4 * 32]
        for turn in range(3):
            context = context + tokens(1000 + s * 10 + turn, 8)[: 8 * 32]
            d = router.pick(RouteRequest(token_ids=context + [7] * 5), fleet)
            router.sent(d)
            router.first_token(d)  # sequential: each turn is answered before the next arrives
            counts[d.replica.name] += 1
    return counts


def test_shared_system_prompt_spreads_sessions_on_a_quiet_fleet() -> None:
    from yieldgate.cache.routing import RouterConfig

    fleet = [Replica(n) for n in "abcd"]
    guarded = _shared_system_prompt_sessions(Router("cache_aware", PrefixIndex()), fleet, 40)
    unguarded = _shared_system_prompt_sessions(
        Router("cache_aware", PrefixIndex(), config=RouterConfig(share_factor=0, share_weight=0)), fleet, 40)
    # Without the share guard the 8 shared blocks pull every new session to one replica.
    assert max(unguarded.values()) == 120
    assert max(guarded.values()) <= 1.25 * 120 / 4, guarded


def test_one_common_header_block_does_not_outweigh_a_replicas_excess_share() -> None:
    # Nothing in flight; "a" holds a one-block common header (a date line, a cache salt) and
    # has taken twice the mean of recent picks, "b" holds nothing.
    ctx = RouteContext(request=RouteRequest(), block_hashes=list(range(20)), block_size=32,
                       matches={"a": 1}, loads={"a": 0.0, "b": 0.0}, recent={"a": 40.0, "b": 0.0})
    fleet = [Replica("a"), Replica("b")]
    plain = KVCostScorer(share_weight=0).score(ctx, fleet)
    assert plain["a"] > plain["b"]  # the header block alone wins without the share term
    shared = KVCostScorer().score(ctx, fleet)
    assert shared["b"] > shared["a"]
    # A long cached context still wins over the share term.
    deep = msgspec.structs.replace(ctx, matches={"a": 18})
    assert KVCostScorer().score(deep, fleet)["a"] > KVCostScorer().score(deep, fleet)["b"]


def test_a_system_prompt_longer_than_the_keep_bar_gets_a_second_home() -> None:
    """37 shared blocks (an agent's system prompt and tools) outweigh `share_keep_blocks`: without
    the seed rule every session stays on the replica that cached the head first."""
    from yieldgate.cache.routing import RouterConfig

    fleet = [Replica("a"), Replica("b")]
    seeded = _shared_system_prompt_sessions(Router("cache_aware", PrefixIndex()), fleet, 16, system_blocks=37)
    unseeded = _shared_system_prompt_sessions(
        Router("cache_aware", PrefixIndex(), config=RouterConfig(share_seed_fraction=0)), fleet, 16,
        system_blocks=37)
    assert sorted(unseeded.values()) == [0, 48]
    assert max(seeded.values()) <= 1.25 * 48 / 2, seeded


@pytest.mark.parametrize(("recent", "matches", "kept"), [
    ({"a": 40.0, "b": 0.0}, {"a": 30, "b": 0}, False),  # every pick, the head nowhere else: seeded
    ({"a": 40.0, "b": 0.0}, {"a": 30, "b": 20}, True),  # the head is on "b" too: 10 blocks of its own
    ({"a": 40.0, "b": 10.0}, {"a": 30, "b": 0}, True),  # 80% of the picks: its savings keep it
    ({"a": 12.0, "b": 0.0}, {"a": 30, "b": 0}, True),   # a young router: under 8 picks over the mean
])
def test_share_guard_seeds_a_head_only_from_a_replica_taking_nearly_every_pick(recent, matches, kept) -> None:
    ctx = RouteContext(request=RouteRequest(), block_hashes=list(range(40)), block_size=32, matches=matches,
                       loads=dict.fromkeys(matches, 0.0), recent=recent)
    names = [c.name for c in ShareFilter().filter(ctx, [Replica("a"), Replica("b")])]
    assert names == (["a", "b"] if kept else ["b"])


def test_share_guard_keeps_long_cached_contexts_home() -> None:
    router = Router("cache_aware", PrefixIndex())
    fleet = [Replica("a"), Replica("b")]
    long_context = tokens(5, 40)
    home = router.pick(RouteRequest(token_ids=long_context), fleet)
    router.sent(home)
    router.first_token(home)
    other = "b" if home.replica.name == "a" else "a"
    for i in range(30):  # the home replica is far past its share of picks...
        router.recent.add(home.replica.name, 2)
    for i in range(8):  # ...though not taking nearly all of them (that would seed its head elsewhere)
        router.recent.add(other, 2)
    # ...but 40 cached blocks (>= share_keep_blocks more than elsewhere) keep the turn there.
    d = router.pick(RouteRequest(token_ids=long_context + [9] * 40), fleet)
    assert d.replica.name == home.replica.name and d.predicted_cached_tokens == 40 * 32
    # A short prefix does not: the next new request goes to the other replica.
    assert router.pick(RouteRequest(token_ids=tokens(6, 2)), fleet).replica.name != home.replica.name


@pytest.mark.parametrize(("matches", "kept"), [
    # "b" and "c" are within their share; "a" is far past it.
    ({"a": 25, "b": 0, "c": 0}, True),    # nothing of the head is elsewhere: 25 >= 16 blocks keep it
    ({"a": 12, "b": 0, "c": 0}, False),   # a 12-block head spreads to a replica within its share
    ({"a": 28, "b": 25, "c": 0}, True),   # the head has spread; 3 blocks of the session's own turns keep it
    ({"a": 26, "b": 25, "c": 0}, False),  # one block of its own does not
    ({"a": 40, "b": 2, "c": 0}, True),    # a common 2-block header is not a spread head: 38 >= 16
    ({"a": 14, "b": 2, "c": 0}, False),   # ...and 12 more blocks are not enough
])
def test_share_guard_keeps_a_sessions_own_context_once_the_shared_head_has_spread(matches, kept) -> None:
    ctx = RouteContext(request=RouteRequest(), block_hashes=list(range(60)), block_size=16, matches=matches,
                       loads=dict.fromkeys(matches, 0.0), recent={"a": 60.0, "b": 20.0, "c": 20.0})
    fleet = [Replica("a"), Replica("b"), Replica("c")]
    names = [c.name for c in ShareFilter().filter(ctx, fleet)]
    assert names == (["a", "b", "c"] if kept else ["b", "c"])


@pytest.mark.parametrize(("affinity", "kept"), [
    # "a" is far past its share; "b" still holds the adapter's blocks from an earlier residency.
    ({"a": 1.0, "b": 0.0, "c": 0.0}, True),   # only "a" holds the adapter: moving it means a load
    ({"a": 1.0, "b": 0.0, "c": 0.5}, True),   # ...a free slot elsewhere still means a load
    ({"a": 1.0, "b": 1.0, "c": 0.0}, False),  # "b" holds it too, within its share
    (None, False),                            # a base-model request: the cache alone decides
])
def test_share_guard_does_not_move_an_adapter_request_off_its_holder(affinity, kept) -> None:
    matches = {"a": 20, "b": 20, "c": 0}
    ctx = RouteContext(request=RouteRequest(adapter_affinity=affinity), block_hashes=list(range(30)), block_size=32,
                       matches=matches, loads=dict.fromkeys(matches, 0.0), recent={"a": 60.0, "b": 20.0, "c": 20.0})
    fleet = [Replica("a"), Replica("b"), Replica("c")]
    names = [c.name for c in ShareFilter().filter(ctx, fleet)]
    assert names == (["a", "b", "c"] if kept else ["b", "c"])


def test_session_policy_is_sticky_and_needs_no_tokens() -> None:
    router = Router("session")
    assert not router.needs_tokens
    fleet = [Replica("a"), Replica("b"), Replica("c")]
    homes = {sid: router.pick(RouteRequest(session_id=sid), fleet).replica.name for sid in map(str, range(30))}
    assert len(set(homes.values())) == 3
    for sid, home in homes.items():
        assert router.pick(RouteRequest(session_id=sid), list(reversed(fleet))).replica.name == home
    # Removing a replica only moves that replica's sessions.
    smaller = [r for r in fleet if r.name != "c"]
    for sid, home in homes.items():
        if home != "c":
            assert router.pick(RouteRequest(session_id=sid), smaller).replica.name == home


def test_round_robin_and_least_loaded() -> None:
    rr = Router("round_robin")
    fleet = [Replica("a"), Replica("b")]
    assert [rr.pick(RouteRequest(), fleet).replica.name for _ in range(4)] == ["a", "b", "a", "b"]
    ll = Router("least_loaded")
    assert ll.pick(RouteRequest(), [Replica("a", inflight=3), Replica("b", num_waiting=1)]).replica.name == "b"
    assert not rr.needs_tokens and not ll.needs_tokens and Router("cache_aware").needs_tokens
    with pytest.raises(UnknownPolicy):
        Router("fastest")


def test_lru_forgets_what_the_engine_evicts() -> None:
    index = PrefixIndex(PrefixIndexConfig(default_capacity_blocks=100))
    router = Router("cache_aware", index)
    fleet = [Replica("a", kv_capacity_blocks=20)]
    old = router.pick(RouteRequest(token_ids=tokens(1, 8)), fleet)
    router.sent(old)
    assert index.capacity("a") == 20
    for p in range(2, 5):  # 24 newer blocks push the oldest out
        router.sent(router.pick(RouteRequest(token_ids=tokens(p, 8)), fleet))
    assert index.match(old.block_hashes).get("a", 0) == 0
    stats = index.stats()
    assert stats.replicas["a"] == 20 and stats.evicted == 12 and stats.total_blocks == 20


def test_index_total_memory_is_bounded() -> None:
    index = PrefixIndex(PrefixIndexConfig(default_capacity_blocks=1000, max_total_blocks=50))
    for r in "abc":
        index.record(r, list(range(hash(r) % 1000, hash(r) % 1000 + 40)))
    assert index.stats().total_blocks == 50


async def _cleanup(clients: list, prefix: str) -> None:
    async for key in clients[0].scan_iter(match=prefix + ":*"):
        await clients[0].delete(key)
    for c in clients:
        await c.aclose()


async def _eventually(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.02)


async def test_two_gateways_sharing_redis_agree(redis_url: str) -> None:
    # Separate connections, as two gateway processes would have.
    clients = [aioredis.Redis.from_url(redis_url) for _ in range(3)]
    prefix = f"yg-test-cache-{uuid.uuid4().hex[:8]}"  # own keys: a killed run's leftovers do not count
    try:
        await _shared_index_scenario(clients, prefix)
    finally:
        await _cleanup(clients, prefix)


async def _shared_index_scenario(clients: list, prefix: str) -> None:
    config = PrefixIndexConfig(redis_key_prefix=prefix)
    a, b = SharedPrefixIndex(clients[0], config), SharedPrefixIndex(clients[1], config)
    await a.start()
    await b.start()
    try:
        ra, rb = Router("cache_aware", a), Router("cache_aware", b)
        fleet = [Replica("r1"), Replica("r2"), Replica("r3")]
        decisions = {}
        for prefix_id in range(8):
            d = ra.pick(RouteRequest(token_ids=tokens(prefix_id, 6, 0)), fleet)
            ra.sent(d)
            decisions[prefix_id] = d
        await a.flush()
        last = decisions[7].block_hashes
        await _eventually(lambda: b.match(last).get(decisions[7].replica.name) == len(last))
        for prefix_id, d in decisions.items():
            other = rb.pick(RouteRequest(token_ids=tokens(prefix_id, 6, 1)), fleet)
            assert other.replica.name == d.replica.name
            assert other.predicted_cached_tokens == 6 * 32
        # A gateway that starts later loads the snapshot from Redis.
        c = SharedPrefixIndex(clients[2], config)
        await c.start()
        try:
            assert c.match(last) == a.match(last)
            assert c.stats().total_blocks == a.stats().total_blocks
        finally:
            await c.close()
        # Removals (e.g. BlockRemoved seen by one gateway) propagate too.
        b.remove(decisions[0].replica.name, decisions[0].block_hashes[3:])
        await b.flush()
        await _eventually(lambda: a.match(decisions[0].block_hashes).get(decisions[0].replica.name) == 3)
    finally:
        await a.close()
        await b.close()


async def test_a_write_batch_leaves_redis_as_op_by_op_writes_do(redis_url: str) -> None:
    """Records of one replica are merged into one ZADD per batch; removes and clears in between
    must still apply to exactly the blocks added before them."""
    client = aioredis.Redis.from_url(redis_url)
    run = uuid.uuid4().hex[:8]
    prefixes = (f"yg-test-batch-a-{run}", f"yg-test-batch-b-{run}")
    try:
        states = []
        for prefix, one_by_one in zip(prefixes, (False, True)):
            index = SharedPrefixIndex(client, PrefixIndexConfig(redis_key_prefix=prefix))
            index.set_capacity("r1", 100)
            index.record("r1", [1, 2, 3, 5])
            index.record("r2", [7, 8])
            index.remove("r1", [2, 5])
            index.record("r1", [2, 4])
            index.clear("r2")
            index.record("r2", [9])
            ops, index._pending = index._pending, []
            for batch in ([[op] for op in ops] if one_by_one else [ops]):
                await index._write(batch)
            states.append([sorted(await client.zrange(f"{prefix}:r:{r}", 0, -1)) for r in ("r1", "r2")])
        assert states[0] == states[1] == [[b"1", b"2", b"3", b"4"], [b"9"]]
    finally:
        for prefix in prefixes:
            async for key in client.scan_iter(match=prefix + ":*"):
                await client.delete(key)
        await client.aclose()


async def test_kv_subscriber_applies_events_and_resyncs_after_restart() -> None:
    """A local PUB socket speaks vLLM's wire format; simulates gaps and an engine restart."""
    from yieldgate.cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

    ctx = zmq.asyncio.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    index = PrefixIndex()
    sub = KVEventSubscriber("e", f"tcp://127.0.0.1:{port}", index)
    sub.start()
    enc = msgspec.msgpack.Encoder()

    async def send(seq: int, *events) -> None:
        batch = KVEventBatch(ts=0.0, events=list(events))
        await pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), enc.encode(batch)])

    try:
        # Wait for the subscription to be live (PUB drops messages sent before it).
        for seq in range(100):
            await send(seq, BlockStored(block_hashes=[1], token_ids=[], block_size=32, medium="GPU"))
            await asyncio.sleep(0.05)
            if index.holds("e", 1):
                break
        assert index.holds("e", 1)
        # The hold may come from an earlier message that arrived late: the last one sent is still
        # on its way, and numbering on from an older one would look like an engine restart.
        await _eventually(lambda: sub.last_seq == seq)
        await send(seq + 1, BlockStored(block_hashes=[2, 3, 4], parent_block_hash=1, medium="GPU"),
                   BlockStored(block_hashes=[99], medium="CPU"))
        await _eventually(lambda: index.match([1, 2, 3, 4]) == {"e": 4})
        assert not index.holds("e", 99)  # offloaded tiers do not serve prefix hits here
        await send(seq + 2, BlockRemoved(block_hashes=[3], medium="GPU"))
        await _eventually(lambda: index.match([1, 2, 3, 4]) == {"e": 2})
        # A gap without a replay endpoint: forget everything rather than keep stale blocks.
        await send(seq + 10, BlockStored(block_hashes=[7], medium="GPU"))
        await _eventually(lambda: sub.gaps == 1)
        assert index.blocks("e") == [7]
        # Engine restart: sequence numbers start over -> cleared, then rebuilt from new events.
        await send(0, BlockStored(block_hashes=[8], medium="GPU"))
        await _eventually(lambda: sub.restarts == 1)
        assert index.blocks("e") == [8]
        await send(1, AllBlocksCleared())
        await _eventually(lambda: index.blocks("e") == [])
    finally:
        await sub.stop()
        pub.close(linger=0)


def test_speculation_filter_sends_greedy_requests_to_speculating_replicas_and_sampled_ones_to_plain() -> None:
    """Greedy (and low-temperature) requests go where drafts are verified; sampled ones, and ones
    that leave the temperature to the engine's default of 1, go to a plain replica, however busy:
    there they are served as the plain tier's own requests are."""
    router = Router("speculation_aware", PrefixIndex(), block_size=32)
    fast, plain = Replica("fast-0", speculative=True), Replica("standard-0", num_running=6)
    for temperature, served in ((0.0, "fast-0"), (None, "standard-0"), (1.0, "standard-0"), (0.7, "standard-0")):
        got = router.pick(RouteRequest(token_ids=tokens(1, 2), temperature=temperature), [fast, plain])
        assert got.replica.name == served, temperature
    lenient = Router("speculation_aware", PrefixIndex(), block_size=32,
                     config=RouterConfig(speculate_max_temperature=0.8))
    assert lenient.pick(RouteRequest(token_ids=tokens(1, 2), temperature=0.7), [fast, plain]).replica is fast
    only_plain = [Replica("standard-0"), Replica("standard-1")]  # one kind: the filter keeps all
    assert router.pick(RouteRequest(token_ids=tokens(1, 2), temperature=0.0), only_plain).replica in only_plain


def test_a_plain_tier_needs_the_speculation_filter() -> None:
    from yieldgate.serving.config import FleetConfig, TierConfig

    with pytest.raises(ValueError, match="speculation filter"):
        FleetConfig(tiers={"standard": TierConfig(), "fast": TierConfig(plain_tier="standard")})
    with pytest.raises(ValueError, match="another tier"):
        FleetConfig(tiers={"fast": TierConfig(policy="speculation_aware", plain_tier="fast")})
    FleetConfig(tiers={"standard": TierConfig(), "fast": TierConfig(policy="speculation_aware", plain_tier="standard")})
