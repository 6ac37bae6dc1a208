"""One budget in Redis shared by every replica: a sliding-window log checked and updated by one Lua script.

Why a sliding-window log and not GCRA: GCRA (a token bucket) lets a full burst
through and then refills, so a tenant can pass nearly twice its limit within
one minute; customers and finance read "1,000 requests per minute" as "never
more than 1,000 in any 60 seconds", which only a log of admissions guarantees.
The log also makes TPM refunds exact: each admission's reservation is a field
that release() lowers, and its tokens leave the window with it. The cost, one
sorted-set member per admission within the window, is small at per-tenant RPMs.

Atomicity: every check and update of one acquire runs in one EVALSHA, so two
replicas can never both take the last slot. Time comes from Redis's own clock
(TIME), so replicas with skewed clocks share one window. Concurrency slots are
leases that expire, so a replica that dies mid-request cannot hold a tenant's
slots forever.
"""

from __future__ import annotations

import math

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.ratelimit.base import Decision, LimiterUnavailable, Limits

CONCURRENCY_RETRY_S = 1.0
# A Redis that does not answer within this is treated as down: requests are refused (503), not held.
REDIS_TIMEOUT_S = 1.0
DEFAULT_LEASE_S = 900.0  # longer than any request may run (engine timeouts are shorter)
# A pooled connection idle this long is pinged before use, so one a restarted Redis closed is
# replaced before a request needs it.
HEALTH_CHECK_INTERVAL_S = 5

# KEYS: requests zset (id -> admitted at), tokens hash (id -> reserved), token total, concurrency zset (id -> lease end)
# ARGV: request id, tokens, rpm, tpm, max_concurrent, window_s, lease_s
# Returns strings (Lua numbers would be truncated to integers):
#   {allowed, reason, retry_after_s, used_requests, used_tokens, reset_requests_s, reset_tokens_s}
ACQUIRE = """
local req, tok, total, conc = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local id, cost = ARGV[1], tonumber(ARGV[2])
local rpm, tpm, maxc = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local window, lease = tonumber(ARGV[6]), tonumber(ARGV[7])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000

local expired = redis.call('ZRANGEBYSCORE', req, '-inf', now - window)
if #expired > 0 then
  local freed = 0
  for _, m in ipairs(expired) do
    freed = freed + tonumber(redis.call('HGET', tok, m) or '0')
    redis.call('HDEL', tok, m)
  end
  redis.call('ZREMRANGEBYSCORE', req, '-inf', now - window)
  redis.call('DECRBY', total, freed)
end
redis.call('ZREMRANGEBYSCORE', conc, '-inf', now)

local used_req = redis.call('ZCARD', req)
local used_tok = tonumber(redis.call('GET', total) or '0')
local inflight = redis.call('ZCARD', conc)

local function tokens_free_in(needed)
  if needed <= 0 then return 0 end
  local freed = 0
  local entries = redis.call('ZRANGE', req, 0, -1, 'WITHSCORES')
  for i = 1, #entries, 2 do
    freed = freed + tonumber(redis.call('HGET', tok, entries[i]) or '0')
    if freed >= needed then return math.max(0, tonumber(entries[i + 1]) + window - now) end
  end
  return 0
end
local function reset_req()
  local oldest = redis.call('ZRANGE', req, 0, 0, 'WITHSCORES')
  if #oldest == 0 then return 0 end
  return math.max(0, tonumber(oldest[2]) + window - now)
end

local reason, retry = '', 0
if inflight >= maxc then
  reason, retry = 'concurrency', -1
elseif used_req >= rpm then
  reason, retry = 'requests', reset_req()
elseif cost > tpm then
  reason, retry = 'tokens', -2
elseif used_tok + cost > tpm then
  reason, retry = 'tokens', tokens_free_in(used_tok + cost - tpm)
end
if reason ~= '' then
  return {'0', reason, tostring(retry), tostring(used_req), tostring(used_tok),
          tostring(reset_req()), tostring(tokens_free_in(used_tok))}
end

redis.call('ZADD', req, now, id)
redis.call('HSET', tok, id, cost)
redis.call('INCRBY', total, cost)
redis.call('ZADD', conc, now + lease, id)
local ttl = math.ceil((window + lease) * 1000)
for _, k in ipairs(KEYS) do redis.call('PEXPIRE', k, ttl) end
return {'1', '', '0', tostring(used_req + 1), tostring(used_tok + cost),
        tostring(reset_req()), tostring(tokens_free_in(used_tok + cost))}
"""

# KEYS: as ACQUIRE; ARGV: request id, tokens to give back
RELEASE = """
redis.call('ZREM', KEYS[4], ARGV[1])
local refund = tonumber(ARGV[2])
local held = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
refund = math.min(refund, held)
if refund > 0 then
  redis.call('HINCRBY', KEYS[2], ARGV[1], -refund)
  redis.call('DECRBY', KEYS[3], refund)
end
return refund
"""


class RedisLimiter:
    def __init__(self, url: str, window_s: float = 60.0, key_prefix: str = "tiergate:rl",
                 lease_s: float = DEFAULT_LEASE_S) -> None:
        self.window_s = window_s
        self.lease_s = lease_s
        self.key_prefix = key_prefix
        # A connection error is retried once, at once, on a fresh connection: after Redis restarts,
        # every pooled connection is dead and only the retry tells "stale" from "down". Timeouts are
        # not retried: the script may have run, and running it twice would reserve tokens twice.
        self.client = aioredis.Redis.from_url(
            url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S,
            retry=Retry(NoBackoff(), retries=1), retry_on_error=[RedisConnectionError],
            health_check_interval=HEALTH_CHECK_INTERVAL_S,
        )
        self._acquire = self.client.register_script(ACQUIRE)
        self._release = self.client.register_script(RELEASE)

    def _keys(self, tenant: str) -> list[str]:
        # One hash tag per tenant keeps a tenant's keys in one Redis Cluster slot (a script needs that).
        base = f"{self.key_prefix}:{{{tenant}}}"
        return [f"{base}:req", f"{base}:tok", f"{base}:total", f"{base}:conc"]

    async def acquire(self, tenant: str, limits: Limits, request_id: str, tokens: int) -> Decision:
        try:
            out = await self._acquire(
                keys=self._keys(tenant),
                args=[request_id, tokens, limits.rpm, limits.tpm, limits.max_concurrent, self.window_s, self.lease_s],
            )
        except (RedisConnectionError, RedisTimeoutError) as e:
            # Fail closed: admitting without the shared budget is how limits stop holding across replicas.
            raise LimiterUnavailable(str(e)) from e
        allowed, reason, retry, used_req, used_tok, reset_req, reset_tok = (v.decode() for v in out)
        retry_s = float(retry)
        if retry_s == -1:
            retry_s = CONCURRENCY_RETRY_S
        elif retry_s == -2:
            retry_s = math.inf
        return Decision(
            allowed=allowed == "1",
            reason=reason or None,
            retry_after_s=retry_s,
            limits=limits,
            remaining_requests=limits.rpm - int(used_req),
            remaining_tokens=limits.tpm - int(used_tok),
            reset_requests_s=float(reset_req),
            reset_tokens_s=float(reset_tok),
        )

    async def release(self, tenant: str, request_id: str, reserved_tokens: int, used_tokens: int) -> None:
        await self._release(keys=self._keys(tenant), args=[request_id, max(0, reserved_tokens - used_tokens)])

    async def close(self) -> None:
        await self.client.aclose()
