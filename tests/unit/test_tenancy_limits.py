"""Client keys and their limits, without I/O: the key table, admission, headers, leases, settling."""

from __future__ import annotations

import hashlib

import pytest

from taogate.errors import NotFound
from taogate.key_settings import LimitsSettings
from taogate.proxy.auth import KeyCheck
from taogate.proxy.priority import resolve
from taogate.request_record import RequestRecord
from taogate.settings import ConfigError, Settings
from taogate.tenancy.fairshare import FairShare
from taogate.tenancy.keys import KeyTable, Tenant, new_key
from taogate.tenancy.limiter import Limiter, RateLimited


def settings_with(*keys: dict[str, object], **limits: object) -> Settings:
    return Settings.model_validate({"keys": list(keys), "limits": limits})


def test_keys_are_found_by_their_hash_from_env_or_from_the_file() -> None:
    secret = new_key()
    s = settings_with(
        {"name": "a", "key_env": "A_KEY", "requests_per_minute": 5},
        {"name": "b", "key_sha256": hashlib.sha256(secret.encode()).hexdigest().upper()},
        max_priority=2,
    )
    table = KeyTable.from_settings(s, {"A_KEY": "alpha"}, "the-unified-key")
    a = table.find(b"alpha")
    assert a is not None and (a.name, a.requests_per_minute) == ("a", 5)
    b = table.find(secret.encode())
    assert b is not None and b.name == "b"
    unified = table.find(b"the-unified-key")
    assert unified is table.unified and unified.max_priority == 2
    assert table.find(b"alphb") is None and table.find(b"") is None
    with pytest.raises(ConfigError, match="A_KEY"):
        KeyTable.from_settings(s, {}, "the-unified-key")
    with pytest.raises(ConfigError, match="keys must differ"):
        KeyTable.from_settings(s, {"A_KEY": "the-unified-key"}, "the-unified-key")


def test_key_settings_are_checked() -> None:
    for bad in (
        {"name": "x"},  # no secret
        {"name": "x", "key_env": "E", "key_sha256": "0" * 64},  # both
        {"name": "unified", "key_env": "E"},  # the unified key's name
        {"name": "x", "key_sha256": "abc"},
    ):
        with pytest.raises(ValueError, match=r"\[\[keys\]\]"):
            settings_with(bad)
    with pytest.raises(ValueError, match="repeated: x"):
        settings_with({"name": "x", "key_env": "E"}, {"name": "x", "key_env": "F"})
    with pytest.raises(ValueError, match="redis://"):
        settings_with(store="http://127.0.0.1:6379")


def test_the_check_says_whose_key_a_request_carries() -> None:
    s = settings_with({"name": "team-a", "key_env": "A_KEY"})
    check = KeyCheck("uni", None, KeyTable.from_settings(s, {"A_KEY": "alpha"}, "uni"))
    assert check.check_request([(b"authorization", b"Bearer uni")], either=False).name == "unified"
    assert check.check_request([(b"authorization", b"Bearer alpha")], either=False).name == "team-a"
    assert check.check_request([(b"x-api-key", b"alpha")], either=True).name == "team-a"
    for headers in ([(b"x-api-key", b"alpha")], [(b"authorization", b"Bearer beta")], []):
        with pytest.raises(Exception, match="API key"):
            check.check_request(headers, either=False)


def test_the_bearer_scheme_is_read_in_any_case_for_every_key() -> None:
    """HTTP's scheme names are case-insensitive: the unified key once needed exactly ``Bearer``
    when the named ones (and a fleet with none) did not."""
    alone = KeyCheck("uni", "adm")
    assert alone.check_request([(b"authorization", b"bearer uni")], either=False).name == "unified"
    assert alone.check_request([(b"authorization", b"BEARER uni")], either=False).name == "unified"
    alone.check_admin(b"bearer adm")
    for refused in (b"Bearer uni", b"Basic adm", b"bearer", None):
        with pytest.raises(Exception, match="admin key"):
            alone.check_admin(refused)
    with pytest.raises(Exception, match="API key"):
        alone.check_request([(b"authorization", b"Token uni")], either=False)


def test_a_priority_above_the_ceiling_is_lowered_to_it_and_told() -> None:
    assert resolve(b"-5", None, {}, "body", ceiling=0) == (0, None)  # the default: nothing to tell
    assert resolve(None, None, {"priority": -5}, "body", ceiling=0) == (0, 0)  # written over the body's
    assert resolve(b"-5", None, {}, "body", ceiling=-10) == (-5, -5)
    assert resolve(None, None, {}, "body", ceiling=3) == (3, 3)  # a batch key is always batch
    assert resolve(None, None, None, "none", ceiling=3) == (3, None)
    assert resolve(b"7", None, {}, "header", ceiling=3) == (7, 7)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def limiter_for(*tenants: Tenant, clock: Clock, **limits: object) -> Limiter:
    table = KeyTable(Tenant("unified"), {bytes([i]) * 32: t for i, t in enumerate(tenants)})
    return Limiter(table, LimitsSettings.model_validate(limits), clock=clock, fair=FairShare())


async def test_requests_over_the_limit_get_openai_s_429_with_headers() -> None:
    clock = Clock()
    team = Tenant("team", requests_per_minute=2, tokens_per_minute=1000)
    limiter = limiter_for(team, clock=clock)
    first = await limiter.check(team, None, 100)
    headers = dict(first.headers)
    assert headers[b"x-ratelimit-limit-requests"] == b"2"
    assert headers[b"x-ratelimit-remaining-requests"] == b"1"
    assert headers[b"x-ratelimit-remaining-tokens"] == b"900"
    assert headers[b"x-ratelimit-reset-requests"].endswith(b"s")
    await limiter.check(team, None, 100)
    with pytest.raises(RateLimited) as refused:
        await limiter.check(team, None, 100)
    exc = refused.value
    assert (exc.status, exc.code, exc.type) == (429, "rate_limit_exceeded", "requests")
    sent = dict(exc.headers())
    assert sent[b"x-ratelimit-remaining-requests"] == b"0"
    assert int(sent[b"retry-after"]) >= 1 and int(sent[b"retry-after-ms"]) > 0
    assert limiter.stats["team"].rejections == {"requests": 1}


async def test_tokens_reserved_are_settled_from_usage_and_given_back_when_nothing_was_served() -> None:
    clock = Clock()
    team = Tenant("team", tokens_per_minute=1000)
    limiter = limiter_for(team, clock=clock)
    a = await limiter.check(team, None, 600)
    with pytest.raises(RateLimited, match="tokens"):
        await limiter.check(team, None, 600)
    limiter.finish(a, 50, 50, served=True)  # used 100 of the 600 reserved
    b = await limiter.check(team, None, 600)
    limiter.finish(b, None, None, served=False)  # never reached an instance: all 600 back
    c = await limiter.check(team, None, 800)
    assert dict(c.headers)[b"x-ratelimit-remaining-tokens"] == b"100"
    with pytest.raises(RateLimited, match="alone is over the limit") as refused:
        await limiter.check(team, None, 5000)
    assert refused.value.retry_after is None


async def test_fair_share_is_charged_what_was_served_however_many_attempts_it_took() -> None:
    """Each attempt is charged the prompt estimate at dispatch; the answer's usage replaces them all."""
    team = Tenant("team")
    limiter = limiter_for(team, clock=Clock())
    admission = await limiter.check(team, None, 100)
    for _ in range(3):  # dispatched three times: two attempts failed over
        limiter.fair.charge(admission.share, 100)
    rec = RequestRecord("r", "completions", 0.0, instance="i0", status=200, prompt_tokens_est=100)
    rec.prompt_tokens, rec.completion_tokens, rec.retries = 120, 10, 2
    limiter.release(admission, rec)
    assert limiter.fair.counter(admission.share) == 130


async def test_concurrency_is_a_lease_released_exactly_once() -> None:
    clock = Clock()
    team = Tenant("team", max_concurrency=1)
    limiter = limiter_for(team, clock=clock)
    held = await limiter.check(team, None, 1)
    with pytest.raises(RateLimited, match="in flight"):
        await limiter.check(team, None, 1)
    limiter.finish(held, None, None, served=True)
    limiter.finish(held, None, None, served=True)  # a second exit path: no double release
    assert limiter.stats["team"].in_flight == 0
    again = await limiter.check(team, None, 1)
    assert limiter.stats["team"].in_flight == 1
    limiter.finish(again, 1, 1, served=True)


async def test_a_key_revoked_and_added_back_while_its_request_runs_still_counts_it() -> None:
    team = Tenant("team", max_concurrency=1)
    limiter = limiter_for(team, clock=Clock())
    held = await limiter.check(team, None, 1)
    assert limiter.configure(KeyTable(Tenant("unified"), {}), LimitsSettings()) == ["team"]
    limiter.configure(KeyTable(Tenant("unified"), {b"t" * 32: team}), LimitsSettings())
    with pytest.raises(RateLimited, match="in flight"):
        await limiter.check(team, None, 1)
    limiter.finish(held, None, None, served=True)
    assert limiter.stats["team"].in_flight == 0


async def test_a_model_outside_the_allow_list_is_openai_s_model_not_found() -> None:
    team = Tenant("team", models=frozenset({"small"}))
    limiter = limiter_for(team, clock=Clock())
    await limiter.check(team, "small", 1)
    with pytest.raises(NotFound) as refused:
        await limiter.check(team, "big", 1)
    assert refused.value.code == "model_not_found" and "do not have access" in refused.value.message


async def test_reload_drops_revoked_keys_and_keeps_the_others_counts() -> None:
    clock = Clock()
    a, b = Tenant("a", requests_per_minute=5), Tenant("b")
    limiter = limiter_for(a, b, clock=clock)
    await limiter.check(a, None, 1)
    gone = limiter.configure(KeyTable(Tenant("unified"), {b"\x00" * 32: a}), limiter.limits)
    assert gone == ["b"] and limiter.stats["a"].requests == 1
