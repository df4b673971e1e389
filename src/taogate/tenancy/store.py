"""Where the counters live: in this process (the default), or in Redis, shared by every replica.

Both run the same check (``window.hit``): in Redis as one Lua script, so a check and its count are
one atomic round trip, timed by the Redis server's clock (replicas need not agree on the time). A
key's counters are one small hash that expires two windows after its last use.

In Redis the same round trip also holds ``max_concurrency`` across replicas: each admitted request
is a lease in a sorted set of the key, scored by when it lapses. Its replica renews its leases
(``renew``) and removes each at the request's end (``leave``); a replica that dies leaves leases
that lapse ``LEASE_TTL_MS`` later. In this process the key's own in-flight count holds it.
"""

from __future__ import annotations

from typing import Any, Protocol

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from taogate.tenancy.window import Counts, State, hit, settle

__all__ = ["HIT_SCRIPT", "LEASE_RENEW_S", "LEASE_TTL_MS", "LocalStore", "RedisStore", "Store"]

#: A lease of the shared ``max_concurrency`` lapses this long after it was taken or last renewed;
#: its replica renews it every ``LEASE_RENEW_S``, so two renewals may fail before it lapses.
LEASE_TTL_MS = 30_000
LEASE_RENEW_S = 10.0

#: ``window.hit`` in Lua. KEYS[1]: the key's hash, KEYS[2]: its leases; ARGV: window ms, rpm, tpm,
#: cost (0: no limit), now in ms ('' for the server's clock), max concurrency (0: none), the
#: lease's name and how long it lasts. Returns admitted (2: refused, the leases are all taken),
#: the four counts, bucket, now.
HIT_SCRIPT = """
local window = tonumber(ARGV[1])
local now = tonumber(ARGV[5])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local bucket = math.floor(now / window)
local frac = (now - bucket * window) / window
local s = redis.call('HMGET', KEYS[1], 'b', 'rp', 'rc', 'tp', 'tc', 'w')
local b = tonumber(s[1]) or bucket
local rp, rc = tonumber(s[2]) or 0, tonumber(s[3]) or 0
local tp, tc = tonumber(s[4]) or 0, tonumber(s[5]) or 0
if tonumber(s[6]) ~= window then
  b, rp, rc, tp, tc = bucket, 0, 0, 0, 0
end
if bucket == b + 1 then
  rp, tp, rc, tc = rc, tc, 0, 0
elseif bucket > b + 1 then
  rp, rc, tp, tc = 0, 0, 0, 0
end
b = math.max(bucket, b)
local maxc = tonumber(ARGV[6]) or 0
if maxc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  if redis.call('ZCARD', KEYS[2]) >= maxc then
    return {2, rp, rc, tp, tc, b, now}
  end
end
local rpm, tpm, cost = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local ok = 1
if rpm > 0 and rp * (1 - frac) + rc + 1 > rpm then ok = 0 end
if tpm > 0 and tp * (1 - frac) + tc + cost > tpm then ok = 0 end
if ok == 1 then
  rc = rc + 1
  tc = tc + cost
end
redis.call('HSET', KEYS[1], 'b', b, 'rp', rp, 'rc', rc, 'tp', tp, 'tc', tc, 'w', window)
redis.call('PEXPIRE', KEYS[1], window * 2)
if ok == 1 and maxc > 0 then
  local ttl = tonumber(ARGV[8])
  redis.call('ZADD', KEYS[2], now + ttl, ARGV[7])
  redis.call('PEXPIRE', KEYS[2], ttl * 2)
end
return {ok, rp, rc, tp, tc, b, now}
"""

#: Leases renewed: KEYS[1] a key's leases; ARGV: how long they last, 1 to bring back those gone
#: (after the store was down: lapsed, or lost with a restart) or 0 not to, then the names.
RENEW_SCRIPT = """
local t = redis.call('TIME')
local until_ = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
for i = 3, #ARGV do
  if ARGV[2] == '1' then
    redis.call('ZADD', KEYS[1], until_, ARGV[i])
  else
    redis.call('ZADD', KEYS[1], 'XX', until_, ARGV[i])
  end
end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]) * 2)
return 1
"""

#: ``window.settle`` in Lua. KEYS[1]: the key's hash; ARGV: the reserving bucket, the correction.
SETTLE_SCRIPT = """
local b = tonumber(redis.call('HGET', KEYS[1], 'b'))
local at = tonumber(ARGV[1])
local field
if b == at then field = 'tc' elseif b == at + 1 then field = 'tp' else return 0 end
local v = math.max(0, (tonumber(redis.call('HGET', KEYS[1], field)) or 0) + tonumber(ARGV[2]))
redis.call('HSET', KEYS[1], field, v)
return 1
"""


class Store(Protocol):
    async def hit(
        self,
        name: str,
        window_ms: int,
        *,
        rpm: int,
        tpm: int,
        cost: int,
        lease: str = "",
        max_concurrency: int = 0,
    ) -> Counts: ...

    async def renew(self, name: str, leases: list[str], restore: bool = False) -> None: ...

    async def leave(self, name: str, lease: str) -> None: ...

    async def settle(self, name: str, bucket: int, delta: int) -> None: ...

    async def ping(self) -> None: ...

    async def aclose(self) -> None: ...


class LocalStore:
    """The counters in this process, on an injected clock (seconds)."""

    def __init__(self, clock: Any) -> None:
        self._clock = clock
        self._states: dict[str, State] = {}

    def hit_now(self, name: str, window_ms: int, *, rpm: int, tpm: int, cost: int) -> Counts:
        now_ms = int(self._clock() * 1000)
        state, counts = hit(self._states.get(name), now_ms, window_ms, rpm=rpm, tpm=tpm, cost=cost)
        self._states[name] = state
        return counts

    async def hit(
        self,
        name: str,
        window_ms: int,
        *,
        rpm: int,
        tpm: int,
        cost: int,
        lease: str = "",
        max_concurrency: int = 0,
    ) -> Counts:
        """The window's check; the concurrency is the limiter's in-flight count here."""
        return self.hit_now(name, window_ms, rpm=rpm, tpm=tpm, cost=cost)

    async def renew(self, name: str, leases: list[str], restore: bool = False) -> None:
        return None

    async def leave(self, name: str, lease: str) -> None:
        return None

    def state(self, name: str) -> State | None:
        return self._states.get(name)

    def settle_now(self, name: str, bucket: int, delta: int) -> None:
        state = self._states.get(name)
        if state is not None:
            settle(state, bucket, delta)

    async def settle(self, name: str, bucket: int, delta: int) -> None:
        self.settle_now(name, bucket, delta)

    def forget(self, keep: set[str]) -> None:
        """Drop the counters of keys no longer configured."""
        for name in [n for n in self._states if n not in keep]:
            del self._states[name]

    async def ping(self) -> None:
        """Always there."""

    async def aclose(self) -> None:
        return None


class RedisStore:
    """The counters in Redis (redis-py's asyncio client); every call bounded by ``timeout``."""

    def __init__(self, url: str, timeout: float, prefix: str = "taogate:limits:") -> None:
        # One immediate retry on a broken connection: after a Redis restart every pooled connection
        # is dead, and without it each failed one request (a 503 under fail_closed) as it came up.
        # Not on a timeout, after which the script may have run: run again, it would count twice.
        self._client: redis.Redis = redis.Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        )
        self._hit = self._client.register_script(HIT_SCRIPT)
        self._settle = self._client.register_script(SETTLE_SCRIPT)
        self._renew = self._client.register_script(RENEW_SCRIPT)
        self._prefix = prefix

    def _key(self, name: str) -> str:
        return f"{self._prefix}{{{name}}}"  # the name as hash tag: one slot per key in a cluster

    def _leases(self, name: str) -> str:
        return f"{self._prefix}{{{name}}}:leases"

    async def hit(
        self,
        name: str,
        window_ms: int,
        *,
        rpm: int,
        tpm: int,
        cost: int,
        lease: str = "",
        max_concurrency: int = 0,
        now_ms: int | None = None,
    ) -> Counts:
        """The window's check and, with ``max_concurrency``, the lease ``lease`` taken if it fits."""
        now = "" if now_ms is None else str(now_ms)
        keys = [self._key(name), self._leases(name)]
        args: list[str | int] = [window_ms, rpm, tpm, cost, now, max_concurrency, lease, LEASE_TTL_MS]
        ok, rp, rc, tp, tc, bucket, at = (int(v) for v in await self._hit(keys=keys, args=args))
        frac = (at - bucket * window_ms) / window_ms
        return Counts(ok == 1, rp, rc, tp, tc, bucket, frac, busy=ok == 2)

    async def renew(self, name: str, leases: list[str], restore: bool = False) -> None:
        """``leases`` live ``LEASE_TTL_MS`` more; ``restore``: those gone are added again."""
        await self._renew(keys=[self._leases(name)], args=[LEASE_TTL_MS, int(restore), *leases])

    async def leave(self, name: str, lease: str) -> None:
        await self._client.zrem(self._leases(name), lease)

    async def settle(self, name: str, bucket: int, delta: int) -> None:
        await self._settle(keys=[self._key(name)], args=[bucket, delta])

    async def ping(self) -> None:
        await self._client.ping()

    async def aclose(self) -> None:
        await self._client.aclose()
