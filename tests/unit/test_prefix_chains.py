"""How far a plain prompt's prefix runs on an instance: its chain, and the chains sent there."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from taogate.dispatch.calibration import TokenEstimator
from taogate.dispatch.prefix import BLOCK_CHARS, MAX_BLOCKS, SharedPrefix, shared_prefix
from taogate.dispatch.prefix_chains import PromptChain, SentChains
from taogate.dispatch.types import RequestFacts
from taogate.fleet.cache_state import InstanceCache

DOC = "".join(f"line {i}: the report says the quarter went as planned.\n" for i in range(200))  # ~11 K
HEADER = "Answer from the document below only, and say so when it does not tell. " * 40  # ~2.9 K


def prompt(text: str) -> SharedPrefix:
    found = shared_prefix("/v1/completions", {"model": "m", "prompt": text})
    assert found is not None
    return found


def chars(size: object) -> int:
    return getattr(size, "ascii", 0)


def chain(text: str) -> PromptChain:
    return PromptChain(prompt(text), chars)


def test_a_plain_prompt_hashes_its_following_whole_blocks() -> None:
    found = prompt(DOC + "question")
    whole = len(DOC + "question") // BLOCK_CHARS
    assert len(found.chain) == whole - 1
    assert found.size.ascii == BLOCK_CHARS
    assert len(prompt("x" * (BLOCK_CHARS * (MAX_BLOCKS + 5))).chain) == MAX_BLOCKS - 1
    assert prompt("x" * (BLOCK_CHARS + 10)).chain == ()  # no second whole block


def test_a_chain_prices_its_key_block_and_each_run_after_it() -> None:
    c = chain(DOC)
    assert c.tokens(0) == BLOCK_CHARS
    assert c.tokens(2) == 3 * BLOCK_CHARS
    assert c.tokens(10_000) == len(DOC) // BLOCK_CHARS * BLOCK_CHARS  # no further than its blocks
    assert c.tokens(-1) == BLOCK_CHARS


def test_an_instance_holds_the_documents_sent_to_it() -> None:
    sent = SentChains()
    a, b = chain(HEADER + "A" * 6000), chain(HEADER + "B" * 6000)
    assert sent.run(a.hashes) == 0
    sent.add(a.hashes, 256)
    assert sent.run(a.hashes) == len(a.hashes)
    assert sent.run(chain(HEADER + "A" * 6000 + "question").hashes) == len(a.hashes)
    assert sent.run(b.hashes) == 1  # the header's second whole block only: the third holds its end
    assert b.tokens(sent.run(b.hashes)) == 2 * BLOCK_CHARS


def test_tails_go_first_so_a_held_hash_keeps_its_prefix() -> None:
    sent = SentChains(capacity=4 * 256)
    a = chain(DOC)  # 9 hashes
    sent.add(a.hashes, 256)
    assert len(sent) == 4 and sent.tokens == 4 * 256
    assert sent.run(a.hashes) == 4  # the four leading ones, the tail evicted
    sent.resize(2 * 256)
    assert sent.run(a.hashes) == 2 and sent.tokens == 2 * 256
    sent.add(chain(HEADER + "B" * 6000).hashes, 1024)  # denser text: a block is a whole 1,024 tokens
    assert sent.tokens <= 2 * 256 and sent.run(a.hashes) == 0


@settings(max_examples=200, deadline=None)
@given(
    docs=st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 8), st.integers(1, 4)), min_size=1, max_size=12
    ),
    capacity=st.integers(1, 20),
)
def test_what_is_held_is_always_a_prefix_of_each_chain(
    docs: list[tuple[int, int, int]], capacity: int
) -> None:
    """Chains sharing prefixes of several lengths, their blocks of several sizes, added in any
    order under any bound: ``run``'s binary search equals counting the held leading hashes one by
    one, and what is held stays within the bound."""
    sent = SentChains(capacity=capacity)
    chains = [(tuple(range(doc * 100, doc * 100 + n)), size) for doc, n, size in docs]
    for c, size in chains:
        sent.add(c, size)
        assert sent.tokens <= capacity
        for other, _ in chains:
            held = 0
            while held < len(other) and sent.run(other[: held + 1]) == held + 1:
                held += 1
            assert sent.run(other) == held


def test_an_instance_is_priced_at_the_document_it_was_sent() -> None:
    """Two documents under one header: each instance is priced at a hit of its own document only."""
    tokens = TokenEstimator(chars_per_token=4.0)

    def facts(text: str) -> RequestFacts:
        shared = prompt(text)
        size = tokens.estimate("m", shared.size)
        c = PromptChain(shared, lambda s: tokens.estimate("m", s))
        return RequestFacts(
            "m", len(text) // 4, long=False, prefix_key=shared.key, prefix_tokens=size, chain=c
        )

    holds_a, holds_b = InstanceCache(), InstanceCache()
    for cache, text in ((holds_a, HEADER + "A" * 8000), (holds_b, HEADER + "B" * 8000)):
        ticket = cache.dispatched(facts(text + " first question"))
        cache.computed(ticket)
        cache.finished(ticket)
    follower = facts(HEADER + "A" * 8000 + " second question")
    on_a, on_b = holds_a.hit(follower), holds_b.hit(follower)
    assert on_a > 2500  # the header and the document
    assert 0 < on_b < 600  # the header's whole blocks only
