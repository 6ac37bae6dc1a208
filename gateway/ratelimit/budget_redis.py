"""Budget states in Redis, shared by every replica: each operation is one Lua script on one hash per period.

The rules are those of budget_store.py (read its docstring first), kept here in Lua so that
a check and its update are atomic across replicas: two replicas can never both take the last
of a budget, and a request is settled once whoever tries. A tenant's keys share one hash tag,
so a settlement that spans two periods touches one Redis Cluster slot. A period's hash expires
a week after the period ends; when Redis loses it (a restart), the next request rebuilds it
from the ledger.
"""

from __future__ import annotations

import calendar
import math

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.ratelimit.base import LimiterUnavailable
from gateway.ratelimit.budget_store import EPSILON, BudgetKey, Hold, Reservation, Settlement
from gateway.ratelimit.redis_budget import redis_client

KEEP_AFTER_PERIOD_S = 7 * 86400

# KEYS: the period's hash; ARGV: request id, amount, limit, now
RESERVE = """
if redis.call('HEXISTS', KEYS[1], 'loaded') == 0 then return {'load'} end
local v = redis.call('HMGET', KEYS[1], 'spent', 'held')
local spent, held, amount = tonumber(v[1]), tonumber(v[2]), tonumber(ARGV[2])
if spent + held + amount > tonumber(ARGV[3]) then
  return {'0', v[1], v[2]}
end
redis.call('HSET', KEYS[1], 'h:' .. ARGV[1], ARGV[2] .. '|' .. ARGV[4])
return {'1', v[1], redis.call('HINCRBYFLOAT', KEYS[1], 'held', ARGV[2])}
"""

# KEYS: the period's hash; ARGV: spent, loaded_at, cutoff, seconds to keep it, then the counted request ids
LOAD = """
if redis.call('HSETNX', KEYS[1], 'loaded', '1') == 0 then return 0 end
redis.call('HSET', KEYS[1], 'spent', ARGV[1], 'held', '0', 'loaded_at', ARGV[2], 'cutoff', ARGV[3])
for i = 5, #ARGV do redis.call('HSET', KEYS[1], 'c:' .. ARGV[i], '1') end
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 1
"""

# KEYS: the hash it reserved in (the final one when it reserved nothing), the hash of the period it ended in
# ARGV: request id, actual, queued_at, finished_at, reserved here (0/1), require the hold (0/1)
SETTLE = """
local id = ARGV[1]
local hold = false
if ARGV[5] == '1' then
  local h = redis.call('HGET', KEYS[1], 'h:' .. id)
  if h then
    redis.call('HDEL', KEYS[1], 'h:' .. id)
    redis.call('HINCRBYFLOAT', KEYS[1], 'held', '-' .. string.match(h, '^([^|]+)'))
    hold = true
  end
end
if (not hold and ARGV[6] == '1') or redis.call('HEXISTS', KEYS[2], 'loaded') == 0 then return false end
if hold and KEYS[1] == KEYS[2] then
  return redis.call('HINCRBYFLOAT', KEYS[2], 'spent', ARGV[2])
end
if redis.call('HEXISTS', KEYS[2], 'c:' .. id) == 0 then
  local f = redis.call('HMGET', KEYS[2], 'loaded_at', 'cutoff')
  if (hold or tonumber(ARGV[3]) < tonumber(f[1])) and tonumber(ARGV[4]) >= tonumber(f[2]) then
    redis.call('HSET', KEYS[2], 'c:' .. id, '1')
    return redis.call('HINCRBYFLOAT', KEYS[2], 'spent', ARGV[2])
  end
end
return redis.call('HGET', KEYS[2], 'spent')
"""

# KEYS: the period's hash; ARGV: request id
RELEASE = """
local h = redis.call('HGET', KEYS[1], 'h:' .. ARGV[1])
if not h then return 0 end
redis.call('HDEL', KEYS[1], 'h:' .. ARGV[1])
redis.call('HINCRBYFLOAT', KEYS[1], 'held', '-' .. string.match(h, '^([^|]+)'))
return 1
"""

# KEYS: the period's hash
WARN = """
if redis.call('HEXISTS', KEYS[1], 'loaded') == 0 then return 0 end
return redis.call('HSETNX', KEYS[1], 'warned', '1')
"""


def _num(value: float) -> str:
    return repr(float(value))


class RedisBudgetStore:
    def __init__(self, url: str, key_prefix: str = "tiergate:rl") -> None:
        self.key_prefix = key_prefix
        self.client = redis_client(url)
        self._reserve = self.client.register_script(RESERVE)
        self._load = self.client.register_script(LOAD)
        self._settle = self.client.register_script(SETTLE)
        self._release = self.client.register_script(RELEASE)
        self._warn = self.client.register_script(WARN)

    def name(self, key: BudgetKey) -> str:
        start = calendar.timegm(key.start.timetuple())
        return f"{self.key_prefix}:{{{key.tenant}}}:budget:{key.unit}:{key.period}:{start}"

    async def reserve(self, key: BudgetKey, request_id: str, amount: float, limit: float,
                      now: float) -> Reservation | None:
        try:
            out = await self._reserve(keys=[self.name(key)],
                                      args=[request_id, _num(amount), _num(limit + EPSILON * limit), _num(now)])
        except (RedisConnectionError, RedisTimeoutError) as e:
            raise LimiterUnavailable(str(e)) from e  # fail closed, as the rate limiter does
        if out[0] == b"load":
            return None
        return Reservation(out[0] == b"1", float(out[1]), max(0.0, float(out[2])))

    async def load(self, key: BudgetKey, spent: float, counted: list[str], loaded_at: float,
                   cutoff: float) -> None:
        # Relative to the caller's clock (a test's may be in the past), a week past the period's end.
        keep = math.ceil(max(0.0, calendar.timegm(key.end.timetuple()) - loaded_at) + KEEP_AFTER_PERIOD_S)
        await self._load(keys=[self.name(key)], args=[_num(spent), _num(loaded_at), _num(cutoff), keep, *counted])

    async def settle(self, settlement: Settlement) -> float | None:
        st = settlement
        final = self.name(st.final_key)
        out = await self._settle(
            keys=[final if st.hold_key is None else self.name(st.hold_key), final],
            args=[st.request_id, _num(st.actual), _num(st.queued_at), _num(st.finished_at),
                  "0" if st.hold_key is None else "1", "1" if st.require_hold else "0"],
        )
        return None if out is None else float(out)

    async def release(self, key: BudgetKey, request_id: str) -> None:
        await self._release(keys=[self.name(key)], args=[request_id])

    async def state(self, key: BudgetKey) -> tuple[float, float] | None:
        loaded, spent, held = await self.client.hmget(self.name(key), ["loaded", "spent", "held"])
        return None if loaded is None else (float(spent), max(0.0, float(held)))

    async def holds(self, key: BudgetKey) -> list[Hold]:
        out = []
        async for field, value in self.client.hscan_iter(self.name(key), match="h:*"):
            amount, _, admitted_at = value.decode().partition("|")
            out.append(Hold(field.decode()[2:], float(amount), float(admitted_at)))
        return out

    async def first_soft_crossing(self, key: BudgetKey) -> bool:
        return bool(await self._warn(keys=[self.name(key)]))

    async def close(self) -> None:
        await self.client.aclose()
