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
(TIME), so replicas with skewed clocks share one window.

Concurrency slots are short leases (``lease_s``, 30 s by default) that one
heartbeat task per limiter renews every third of a lease for all the requests
this process runs, and that release() drops at once. A replica that dies
(SIGKILL, a lost node) stops renewing, so its slots free within one lease on
every replica instead of being held until a long fixed expiry.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import defaultdict

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.ratelimit.base import Decision, LimiterUnavailable, Limits

log = logging.getLogger(__name__)

CONCURRENCY_RETRY_S = 1.0
# A Redis that does not answer within this is treated as down: requests are refused (503), not held.
REDIS_TIMEOUT_S = 1.0
DEFAULT_LEASE_S = 30.0
# Renewals per lease: two may be lost (a Redis blip) before a live request's slot lapses.
RENEWALS_PER_LEASE = 3
# A pooled connection idle this long is pinged before use, so one a restarted Redis closed is
# replaced before a request needs it.
HEALTH_CHECK_INTERVAL_S = 5

# KEYS: requests zset (id -> admitted at), tokens hash (id -> reserved), token total, concurrency zset (id -> lease end)
# ARGV: request id, tokens, rpm, tpm, max_concurrent, window_s, lease_s, slots
# A request holding several concurrency slots (n x prompts sequences) has one lease member per slot:
# its id, then id#2 .. id#slots (lease_members() below), so ZCARD still counts slots.
# Returns strings (Lua numbers would be truncated to integers):
#   {allowed, reason, retry_after_s, used_requests, used_tokens, reset_requests_s, reset_tokens_s}
ACQUIRE = """
local req, tok, total, conc = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local id, cost = ARGV[1], tonumber(ARGV[2])
local rpm, tpm, maxc = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local window, lease = tonumber(ARGV[6]), tonumber(ARGV[7])
local slots = tonumber(ARGV[8])
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
if inflight + slots > maxc then
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
for k = 2, slots do redis.call('ZADD', conc, now + lease, id .. '#' .. k) end
local ttl = math.ceil((window + lease) * 1000)
for _, k in ipairs(KEYS) do redis.call('PEXPIRE', k, ttl) end
return {'1', '', '0', tostring(used_req + 1), tostring(used_tok + cost),
        tostring(reset_req()), tostring(tokens_free_in(used_tok + cost))}
"""

# KEYS: as ACQUIRE; ARGV: request id, tokens to give back, slots held
RELEASE = """
redis.call('ZREM', KEYS[4], ARGV[1])
for k = 2, tonumber(ARGV[3]) do redis.call('ZREM', KEYS[4], ARGV[1] .. '#' .. k) end
local refund = tonumber(ARGV[2])
local held = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
refund = math.min(refund, held)
if refund > 0 then
  redis.call('HINCRBY', KEYS[2], ARGV[1], -refund)
  redis.call('DECRBY', KEYS[3], refund)
end
return refund
"""

# KEYS: the concurrency zset; ARGV: lease_s, then the lease members of the requests this process still runs.
# XX: a lease that already lapsed (or was released) is not brought back.
RENEW = """
local t = redis.call('TIME')
local until_ = tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(ARGV[1])
local renewed = 0
for i = 2, #ARGV do
  renewed = renewed + redis.call('ZADD', KEYS[1], 'XX', 'CH', until_, ARGV[i])
end
local ttl = redis.call('PTTL', KEYS[1])
local want = math.ceil(tonumber(ARGV[1]) * 1000)
if ttl >= 0 and ttl < want then redis.call('PEXPIRE', KEYS[1], want) end
return renewed
"""


def lease_members(request_id: str, slots: int) -> list[str]:
    """The concurrency zset's members of a request holding ``slots`` slots (as ACQUIRE names them)."""
    return [request_id] + [f"{request_id}#{k}" for k in range(2, slots + 1)]


def redis_client(url: str) -> aioredis.Redis:
    """A client for the shared budgets: it fails fast, and reconnects once at once after a Redis restart.

    A connection error is retried once, at once, on a fresh connection: after Redis restarts, every
    pooled connection is dead and only the retry tells "stale" from "down". Timeouts are not
    retried: the script may have run, and running it twice would reserve twice.
    """
    return aioredis.Redis.from_url(
        url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S,
        retry=Retry(NoBackoff(), retries=1), retry_on_error=[RedisConnectionError],
        health_check_interval=HEALTH_CHECK_INTERVAL_S,
    )


class RedisLimiter:
    def __init__(self, url: str, window_s: float = 60.0, key_prefix: str = "tiergate:rl",
                 lease_s: float = DEFAULT_LEASE_S) -> None:
        self.window_s = window_s
        self.lease_s = lease_s
        self.key_prefix = key_prefix
        self.client = redis_client(url)
        self._acquire = self.client.register_script(ACQUIRE)
        self._release = self.client.register_script(RELEASE)
        self._renew = self.client.register_script(RENEW)
        self._held: dict[str, tuple[str, int]] = {}  # request id -> (tenant, slots), the leases this process renews
        self._heartbeat: asyncio.Task | None = None

    def _keys(self, tenant: str) -> list[str]:
        # One hash tag per tenant keeps a tenant's keys in one Redis Cluster slot (a script needs that).
        base = f"{self.key_prefix}:{{{tenant}}}"
        return [f"{base}:req", f"{base}:tok", f"{base}:total", f"{base}:conc"]

    async def acquire(self, tenant: str, limits: Limits, request_id: str, tokens: int, sequences: int = 1) -> Decision:
        slots = limits.slots_for(sequences)
        try:
            out = await self._acquire(
                keys=self._keys(tenant),
                args=[request_id, tokens, limits.rpm, limits.tpm, limits.max_concurrent, self.window_s, self.lease_s,
                      slots],
            )
        except (RedisConnectionError, RedisTimeoutError) as e:
            # Fail closed: admitting without the shared budget is how limits stop holding across replicas.
            raise LimiterUnavailable(str(e)) from e
        allowed, reason, retry, used_req, used_tok, reset_req, reset_tok = (v.decode() for v in out)
        if allowed == "1":
            self._held[request_id] = (tenant, slots)
            if self._heartbeat is None or self._heartbeat.done():
                self._heartbeat = asyncio.get_running_loop().create_task(self._renew_leases())
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
        # Forgotten first: if Redis is down the lease lapses by itself, as it would after a crash.
        _, slots = self._held.pop(request_id, (tenant, 1))
        await self._release(keys=self._keys(tenant), args=[request_id, max(0, reserved_tokens - used_tokens), slots])

    async def renew(self) -> int:
        """Extend every lease this process holds by ``lease_s`` from now; returns how many slots were renewed."""
        by_tenant: dict[str, list[str]] = defaultdict(list)
        for request_id, (tenant, slots) in list(self._held.items()):
            by_tenant[tenant] += lease_members(request_id, slots)
        renewed = 0
        for tenant, ids in by_tenant.items():
            renewed += int(await self._renew(keys=self._keys(tenant)[3:], args=[self.lease_s, *ids]) or 0)
        return renewed

    async def _renew_leases(self) -> None:
        interval = self.lease_s / RENEWALS_PER_LEASE
        while self._held:
            await asyncio.sleep(interval)
            try:
                await self.renew()
            except Exception:  # Redis away: the next beat tries again; requests are not failed for it
                log.warning("could not renew %d concurrency lease(s)", len(self._held), exc_info=True)

    async def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        await self.client.aclose()
