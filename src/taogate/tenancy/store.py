"""Where the counters live: in this process (the default), or in Redis, shared by every replica.

Both run the same check (``window.hit``): in Redis as one Lua script, so a check and its count are
one atomic round trip, timed by the Redis server's clock (replicas need not agree on the time). A
key's counters are one small hash that expires two windows after its last use.
"""

from __future__ import annotations

from typing import Any, Protocol

import redis.asyncio as redis

from taogate.tenancy.window import Counts, State, hit, settle

__all__ = ["HIT_SCRIPT", "LocalStore", "RedisStore", "Store"]

#: ``window.hit`` in Lua. KEYS[1]: the key's hash; ARGV: window ms, rpm, tpm, cost (0: no limit),
#: and now in ms ('' for the server's clock). Returns admitted, the four counts, bucket, now.
HIT_SCRIPT = """
local window = tonumber(ARGV[1])
local now = tonumber(ARGV[5])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local bucket = math.floor(now / window)
local frac = (now - bucket * window) / window
local s = redis.call('HMGET', KEYS[1], 'b', 'rp', 'rc', 'tp', 'tc')
local b = tonumber(s[1]) or bucket
local rp, rc = tonumber(s[2]) or 0, tonumber(s[3]) or 0
local tp, tc = tonumber(s[4]) or 0, tonumber(s[5]) or 0
if bucket == b + 1 then
  rp, tp, rc, tc = rc, tc, 0, 0
elseif bucket > b + 1 then
  rp, rc, tp, tc = 0, 0, 0, 0
end
b = math.max(bucket, b)
local rpm, tpm, cost = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local ok = 1
if rpm > 0 and rp * (1 - frac) + rc + 1 > rpm then ok = 0 end
if tpm > 0 and tp * (1 - frac) + tc + cost > tpm then ok = 0 end
if ok == 1 then
  rc = rc + 1
  tc = tc + cost
end
redis.call('HSET', KEYS[1], 'b', b, 'rp', rp, 'rc', rc, 'tp', tp, 'tc', tc)
redis.call('PEXPIRE', KEYS[1], window * 2)
return {ok, rp, rc, tp, tc, b, now}
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
    async def hit(self, name: str, window_ms: int, *, rpm: int, tpm: int, cost: int) -> Counts: ...

    async def settle(self, name: str, bucket: int, delta: int) -> None: ...

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

    async def hit(self, name: str, window_ms: int, *, rpm: int, tpm: int, cost: int) -> Counts:
        return self.hit_now(name, window_ms, rpm=rpm, tpm=tpm, cost=cost)

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

    async def aclose(self) -> None:
        return None


class RedisStore:
    """The counters in Redis (redis-py's asyncio client); every call bounded by ``timeout``."""

    def __init__(self, url: str, timeout: float, prefix: str = "taogate:limits:") -> None:
        self._client: redis.Redis = redis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout, retry_on_timeout=False
        )
        self._hit = self._client.register_script(HIT_SCRIPT)
        self._settle = self._client.register_script(SETTLE_SCRIPT)
        self._prefix = prefix

    def _key(self, name: str) -> str:
        return f"{self._prefix}{{{name}}}"  # the name as hash tag: one slot per key in a cluster

    async def hit(
        self, name: str, window_ms: int, *, rpm: int, tpm: int, cost: int, now_ms: int | None = None
    ) -> Counts:
        now = "" if now_ms is None else str(now_ms)
        got = await self._hit(keys=[self._key(name)], args=[window_ms, rpm, tpm, cost, now])
        ok, rp, rc, tp, tc, bucket, at = (int(v) for v in got)
        return Counts(bool(ok), rp, rc, tp, tc, bucket, (at - bucket * window_ms) / window_ms)

    async def settle(self, name: str, bucket: int, delta: int) -> None:
        await self._settle(keys=[self._key(name)], args=[bucket, delta])

    async def aclose(self) -> None:
        await self._client.aclose()
