"""How much of a plain prompt an earlier one with its key shared: whole blocks, bounded memory."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from taogate.dispatch.prefix import BLOCK_CHARS, DIGEST, MAX_BLOCKS, SharedPrefix, shared_prefix
from taogate.dispatch.prefix_chains import PrefixChains, common_blocks

DOC = "".join(f"line {i}: the report says the quarter went as planned.\n" for i in range(200))  # ~11 K


def prompt(text: str) -> SharedPrefix:
    found = shared_prefix("/v1/completions", {"model": "m", "prompt": text})
    assert found is not None
    return found


def test_a_plain_prompt_hashes_its_following_whole_blocks() -> None:
    found = prompt(DOC + "question")
    whole = len(DOC + "question") // BLOCK_CHARS
    assert len(found.chain) == (whole - 1) * DIGEST
    assert found.size.ascii == BLOCK_CHARS
    assert prompt("x" * (BLOCK_CHARS * (MAX_BLOCKS + 5))).chain.__len__() == (MAX_BLOCKS - 1) * DIGEST
    assert prompt("x" * (BLOCK_CHARS + 10)).chain == b""  # no second whole block


def test_a_second_prompt_sharing_a_document_covers_it() -> None:
    chains = PrefixChains()
    first, second = prompt(DOC + "question one"), prompt(DOC + "question two")
    assert first.key == second.key
    assert chains.covered(first) == first.size  # nothing seen before: the key's own block
    covered = chains.covered(second)
    assert len(DOC) - BLOCK_CHARS < covered.ascii <= len(DOC)  # the document, in whole blocks


def test_prompts_sharing_only_the_first_block_cover_only_it() -> None:
    chains = PrefixChains()
    head = DOC[:BLOCK_CHARS]
    chains.covered(prompt(head + "A" * 5000))
    assert chains.covered(prompt(head + "B" * 5000)).ascii == BLOCK_CHARS


def test_the_closest_of_the_kept_prompts_counts() -> None:
    chains = PrefixChains(per_key=2)
    head = DOC[:BLOCK_CHARS]
    a, b = head + "A" * 4096, head + "B" * 8192
    chains.covered(prompt(a))
    chains.covered(prompt(b))
    assert chains.covered(prompt(a + "more")).ascii == BLOCK_CHARS + 4096
    assert chains.covered(prompt(b + "more")).ascii == BLOCK_CHARS + 8192


def test_a_growing_prompt_replaces_the_one_it_extends() -> None:
    chains = PrefixChains(per_key=1)
    chains.covered(prompt(DOC[:3000]))
    chains.covered(prompt(DOC[:6000]))
    chains.covered(prompt(DOC[:4000]))  # shorter: the longer one already covers it, and stays
    assert chains.covered(prompt(DOC[:9000])).ascii == 6000 // BLOCK_CHARS * BLOCK_CHARS


def test_keys_are_bounded_least_recent_first() -> None:
    chains = PrefixChains(keys=2)
    docs = [f"{k} " + DOC for k in range(3)]
    for d in docs:
        chains.covered(prompt(d))
    assert len(chains) == 2
    assert chains.covered(prompt(docs[0])).ascii == BLOCK_CHARS  # forgotten
    assert chains.covered(prompt(docs[2])).ascii > BLOCK_CHARS


@settings(max_examples=200, deadline=None)
@given(
    a=st.lists(st.binary(min_size=DIGEST, max_size=DIGEST), max_size=12),
    b=st.lists(st.binary(min_size=DIGEST, max_size=DIGEST), max_size=12),
)
def test_common_blocks_counts_the_equal_leading_hashes(a: list[bytes], b: list[bytes]) -> None:
    want = 0
    while want < min(len(a), len(b)) and a[want] == b[want]:
        want += 1
    assert common_blocks(b"".join(a), b"".join(b)) == want
