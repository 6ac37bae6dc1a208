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
from gateway.ratelimit.budget_store import (EPSILON, Ask, BudgetKey, BudgetStore, Hold, Reservation, Reservations,
                                            Settlement)
from gateway.ratelimit.redis_budget import redis_client

KEEP_AFTER_PERIOD_S = 7 * 86400

# All of a request's budgets in one script, all or nothing.
# KEYS: the periods' hashes; ARGV: request id, now, then amount and limit per key
# Returns {'load', i...} (states to load first), or {'0'|'1', allowed_i, spent_i, held_i...}
RESERVE = """
local missing = {'load'}
for i = 1, #KEYS do
  if redis.call('HEXISTS', KEYS[i], 'loaded') == 0 then missing[#missing + 1] = tostring(i - 1) end
end
if #missing > 1 then return missing end
local out, all = {'1'}, true
for i = 1, #KEYS do
  local v = redis.call('HMGET', KEYS[i], 'spent', 'held')
  local fits = tonumber(v[1]) + tonumber(v[2]) + tonumber(ARGV[1 + 2 * i]) <= tonumber(ARGV[2 + 2 * i])
  all = all and fits
  out[#out + 1] = fits and '1' or '0'
  out[#out + 1] = v[1]
  out[#out + 1] = v[2]
end
if not all then out[1] = '0'; return out end
for i = 1, #KEYS do
  redis.call('HSET', KEYS[i], 'h:' .. ARGV[1], ARGV[1 + 2 * i] .. '|' .. ARGV[2])
  out[3 * i + 1] = redis.call('HINCRBYFLOAT', KEYS[i], 'held', ARGV[1 + 2 * i])
end
return out
"""

# KEYS: the period's hash; ARGV: spent, loaded_at, cutoff, seconds to keep it, then the counted request ids
LOAD = """
if redis.call('HSETNX', KEYS[1], 'loaded', '1') == 0 then return 0 end
redis.call('HSET', KEYS[1], 'spent', ARGV[1], 'held', '0', 'loaded_at', ARGV[2], 'cutoff', ARGV[3])
for i = 5, #ARGV do redis.call('HSET', KEYS[1], 'c:' .. ARGV[i], '1') end
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 1
"""

# One request's end in each of its budgets, in one script.
# KEYS: per budget, the hash it reserved in (the final one when it reserved nothing) and the hash of the
# period it ended in. ARGV: request id, queued_at, finished_at, require the hold (0/1), then per budget
# its actual cost and whether it reserved there (0/1). Returns each final period's spend, or '' for none.
SETTLE = """
local id = ARGV[1]
local out = {}
for i = 1, #KEYS / 2 do
  local held_in, final = KEYS[2 * i - 1], KEYS[2 * i]
  local actual, reserved = ARGV[3 + 2 * i], ARGV[4 + 2 * i]
  local hold = false
  if reserved == '1' then
    local h = redis.call('HGET', held_in, 'h:' .. id)
    if h then
      redis.call('HDEL', held_in, 'h:' .. id)
      redis.call('HINCRBYFLOAT', held_in, 'held', '-' .. string.match(h, '^([^|]+)'))
      hold = true
    end
  end
  local spent = ''
  if not ((not hold and ARGV[4] == '1') or redis.call('HEXISTS', final, 'loaded') == 0) then
    if hold and held_in == final then
      spent = redis.call('HINCRBYFLOAT', final, 'spent', actual)
    elseif redis.call('HEXISTS', final, 'c:' .. id) == 0 then
      local f = redis.call('HMGET', final, 'loaded_at', 'cutoff')
      if (hold or tonumber(ARGV[2]) < tonumber(f[1])) and tonumber(ARGV[3]) >= tonumber(f[2]) then
        redis.call('HSET', final, 'c:' .. id, '1')
        spent = redis.call('HINCRBYFLOAT', final, 'spent', actual)
      else
        spent = redis.call('HGET', final, 'spent')
      end
    else
      spent = redis.call('HGET', final, 'spent')
    end
  end
  out[i] = spent
end
return out
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


class RedisBudgetStore(BudgetStore):
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

    async def reserve_all(self, asks: list[Ask], request_id: str, now: float) -> Reservations:
        args = [request_id, _num(now)]
        for a in asks:
            args += [_num(a.amount), _num(a.limit + EPSILON * a.limit)]
        try:
            out = await self._reserve(keys=[self.name(a.key) for a in asks], args=args)
        except (RedisConnectionError, RedisTimeoutError) as e:
            raise LimiterUnavailable(str(e)) from e  # fail closed, as the rate limiter does
        if out[0] == b"load":
            return Reservations([int(i) for i in out[1:]], [])
        return Reservations([], [Reservation(out[i] == b"1", float(out[i + 1]), max(0.0, float(out[i + 2])))
                                 for i in range(1, len(out), 3)])

    async def load(self, key: BudgetKey, spent: float, counted: list[str], loaded_at: float,
                   cutoff: float) -> None:
        # Relative to the caller's clock (a test's may be in the past), a week past the period's end.
        keep = math.ceil(max(0.0, calendar.timegm(key.end.timetuple()) - loaded_at) + KEEP_AFTER_PERIOD_S)
        await self._load(keys=[self.name(key)], args=[_num(spent), _num(loaded_at), _num(cutoff), keep, *counted])

    async def settle_all(self, settlements: list[Settlement]) -> list[float | None]:
        """One request's settlements (same id, times and sweep flag), in one script."""
        first = settlements[0]
        keys, args = [], [first.request_id, _num(first.queued_at), _num(first.finished_at),
                          "1" if first.require_hold else "0"]
        for st in settlements:
            final = self.name(st.final_key)
            keys += [final if st.hold_key is None else self.name(st.hold_key), final]
            args += [_num(st.actual), "0" if st.hold_key is None else "1"]
        out = await self._settle(keys=keys, args=args)
        return [float(v) if v not in (b"", None) else None for v in out]

    async def settle(self, settlement: Settlement) -> float | None:
        return (await self.settle_all([settlement]))[0]

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
