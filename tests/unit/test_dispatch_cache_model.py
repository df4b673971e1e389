"""The modelled prefix cache: bounded by the instance's blocks, LRU as vLLM, pinned while in use."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from taogate.dispatch.cache_model import PrefixCacheModel, Ticket


def test_a_key_is_a_hit_only_once_computed_here_and_only_here() -> None:
    here, there = PrefixCacheModel(), PrefixCacheModel()
    _follower_answers(here, range(90, 91), 0)  # an engine whose followers in flight were seen to miss
    assert here.expected_hit(7, 2010, 2040) == 0.0  # never sent: no hit anywhere
    ticket = here.dispatched(7, 2010, 2040, 16)
    # Sent, no first token yet: a follower is priced at its whole prompt, not at a hit.
    assert here.expected_hit(7, 2010, 2040) == 0.0 and here.pinned_hit(7, 2010, 2040) == 0.0
    assert here.sent(7) and not here.holds(7)
    follower = here.dispatched(7, 2010, 2040, 16)
    assert follower.predicted == 0
    here.computed(ticket)  # its first token: the engine has the prefix
    assert here.expected_hit(7, 2010, 2040) == 2000.0  # whole blocks
    assert here.pinned_hit(7, 2010, 2040) == 2000.0
    assert there.expected_hit(7, 2010, 2040) == 0.0
    here.finished(ticket)
    here.finished(follower)
    assert here.expected_hit(7, 2010, 2040) == 2000.0 and here.pinned_hit(7, 2010, 2040) == 0.0


def test_an_answer_with_usage_is_evidence_too() -> None:
    model = PrefixCacheModel()
    ticket = model.dispatched(3, 2000, 2040, 16)
    model.observe_cached(ticket, 0)  # it was prefilled (a miss): the prefix is computed now
    model.finished(ticket)
    assert model.holds(3) and model.trust == 1.0


def test_an_evicted_key_needs_new_evidence() -> None:
    model = PrefixCacheModel(capacity_blocks=140, block_size=16)  # one 2,000-token prefix
    first = model.dispatched(1, 2000, 2040, 16)
    model.computed(first)
    model.finished(first)
    model.finished(model.dispatched(2, 2000, 2040, 16))  # evicts 1
    assert not model.sent(1)
    model.dispatched(1, 2000, 2040, 16)
    assert not model.holds(1)  # in flight again, not computed: a hit only for a follower (``follow``)


def test_the_last_token_is_never_a_hit() -> None:
    model = PrefixCacheModel(block_size=16)
    model.computed(model.dispatched(1, 4096, 4096, 16))
    assert model.expected_hit(1, 4096, 4096) == 4080.0


def test_lru_evicts_the_oldest_unpinned_and_keeps_running_ones() -> None:
    model = PrefixCacheModel(capacity_blocks=300, block_size=16)  # 4,800 tokens
    a = model.dispatched(1, 2000, 2040, 16)
    model.finished(a)
    b = model.dispatched(2, 2000, 2040, 16)  # running: pinned
    model.dispatched(3, 2000, 2040, 16)  # no room for all three: the oldest unpinned (1) goes
    assert not model.sent(1) and model.sent(2) and model.sent(3)
    model.finished(b)
    assert model.used <= model.capacity + 135  # pinned entries may overflow, never by more than them


def test_eviction_cost_counts_reused_prefixes_only() -> None:
    model = PrefixCacheModel(capacity_blocks=260, block_size=16)
    for _ in range(2):
        model.finished(model.dispatched(1, 2000, 2040, 16))  # used twice: hot
    model.finished(model.dispatched(2, 1000, 1040, 16))  # used once
    assert model.eviction_cost(100) == 0.0  # fits
    assert model.eviction_cost(2000) >= 2000.0  # pushes the hot prefix out


def test_trust_follows_what_the_engine_reports() -> None:
    model = PrefixCacheModel()
    model.computed(model.dispatched(1, 2000, 2040, 16))
    ticket = model.dispatched(1, 2000, 2040, 16)
    model.observe_cached(ticket, 0)  # predicted a hit, the engine found nothing
    assert model.trust < 1.0
    assert model.expected_hit(1, 2000, 2040) < 1984.0
    low = model.trust
    model.observe_cached(model.dispatched(1, 2000, 2040, 16), 1984)
    assert model.trust > low


def test_counters_teach_trust_without_exact_answers() -> None:
    model = PrefixCacheModel()
    model.computed(model.dispatched(1, 2000, 2040, 16))
    for _ in range(4):
        model.dispatched(1, 2000, 2040, 16)
    model.observe_counters(0.0)
    assert model.trust < 1.0


def test_a_new_shape_clears_the_model() -> None:
    model = PrefixCacheModel()
    model.dispatched(1, 2000, 2040, 16)
    model.configure(1000, 128)
    assert not model.holds(1) and model.block_size == 128


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(1, 400),
    ops=st.lists(
        st.tuples(st.integers(0, 20), st.integers(0, 3000), st.integers(1, 4000), st.booleans()),
        max_size=60,
    ),
)
def test_property_bounded_by_the_instances_blocks(
    capacity: int, ops: list[tuple[int, int, int, bool]]
) -> None:
    """Whatever is sent, unpinned entries never make the model exceed the instance's capacity, and
    the number of entries never exceeds its blocks plus those pinned by requests in flight."""
    model = PrefixCacheModel(capacity_blocks=capacity, block_size=16)
    open_tickets = []
    for key, prefix, prompt, finish in ops:
        open_tickets.append(model.dispatched(key, min(prefix, prompt), prompt, 16))
        if finish and open_tickets:
            model.finished(open_tickets.pop(0))
        assert len(model) <= capacity + 2 * len(open_tickets)
    for ticket in open_tickets:
        model.finished(ticket)
    assert model.used <= capacity and len(model) <= capacity


def _follower_answers(model: PrefixCacheModel, keys: range, cached: int) -> None:
    """For each key: a leader, then a follower sent while the leader is in flight, whose answer
    says it found ``cached`` tokens (the leader's own answer comes later)."""
    for key in keys:
        model.dispatched(key, 2000, 2040, 16)
        follower = model.dispatched(key, 2000, 2040, 16)
        assert follower.follow == 2000 and follower.predicted == 0
        model.observe_cached(follower, cached)
        model.finished(follower)


def test_in_flight_followers_are_priced_as_hits_until_answers_show_them_missing() -> None:
    model = PrefixCacheModel()
    model.dispatched(10, 2000, 2040, 16)
    # Before any evidence, as real vLLM charges them (it caches blocks as it schedules them).
    assert model.follows and model.expected_hit(10, 2000, 2040) == 2000.0
    assert model.pinned_hit(10, 2000, 2040) == 2000.0
    assert model.expected_hit(11, 2000, 2040) == 0.0  # never sent here: no hit
    _follower_answers(model, range(1, 2), 0)  # one follower missed: the engine caches after prefill
    assert not model.follows and model.expected_hit(10, 2000, 2040) == 0.0
    _follower_answers(model, range(2, 4), 2000)  # followers hit again (a restart, another engine)
    assert model.follows and 0.0 < model.expected_hit(10, 2000, 2040) < 2000.0  # at the learned share
    assert model.dispatched(10, 2000, 2040, 16).follow == 2000


def test_followers_that_miss_keep_the_whole_price_and_silence_keeps_vllms_behaviour() -> None:
    missing = PrefixCacheModel()  # an engine that caches a prompt only once its prefill completes
    _follower_answers(missing, range(1, 9), 0)
    missing.dispatched(10, 2000, 2040, 16)
    assert not missing.follows and missing.expected_hit(10, 2000, 2040) == 0.0
    silent = PrefixCacheModel()  # streams without usage: only first tokens and counters
    for key in range(1, 9):
        silent.computed(silent.dispatched(key, 2000, 2040, 16))
        silent.dispatched(key, 2000, 2040, 16)
    silent.observe_counters(50_000.0)
    assert silent.follows  # no answer said otherwise


@settings(max_examples=80, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["send", "first", "answer", "end"]), st.integers(0, 4)), max_size=60
    ),
)
def test_property_an_engine_that_misses_in_flight_followers_never_prices_them_as_hits(
    ops: list[tuple[str, int]],
) -> None:
    """Whatever the order of sends, first tokens and answers, on an engine whose followers in
    flight were seen to miss (their answers say 0 cached) a key not yet computed here is never a hit."""
    model = PrefixCacheModel(capacity_blocks=600, block_size=16)
    _follower_answers(model, range(90, 91), 0)  # a follower in flight was seen to miss
    tickets: list[Ticket] = []
    for op, key in ops:
        if op == "send":
            tickets.append(model.dispatched(key, 2000, 2040, 16))
        elif tickets:
            ticket = tickets[key % len(tickets)]
            if op == "first":
                model.computed(ticket)
            elif op == "answer":
                model.observe_cached(ticket, ticket.predicted)  # computed hits hit; followers miss
            else:
                model.finished(tickets.pop(key % len(tickets)))
        assert not model.follows
        for k in range(5):
            if not model.holds(k):
                assert model.expected_hit(k, 2000, 2040) == 0.0 == model.pinned_hit(k, 2000, 2040)


def test_what_fits_nowhere_beside_the_running_requests_costs_as_much_as_it_overflows() -> None:
    """A cache of 13 blocks of 128: two running ~600-token prompts fill it; a third prompt fits
    only once one of them ends (vLLM never evicts a running request's blocks), so its blocks that
    fit nowhere count, as evicting a reused prefix does."""
    model = PrefixCacheModel(capacity_blocks=13, block_size=128)
    model.dispatched(1, 595, 610, 4)  # 5 prefix blocks and 1 for the rest: 6
    assert model.eviction_cost(614) == 0.0  # 6 + 5 of 13: fits
    model.dispatched(2, 595, 610, 4)
    assert model.eviction_cost(614) == 4 * 128  # 12 + 5 of 13, nothing unpinned to evict
    model.finished(model.dispatched(3, 100, 120, 4))  # ended: its one block is evictable
    assert model.eviction_cost(614) == 4 * 128  # still 4 blocks short beside the running two
