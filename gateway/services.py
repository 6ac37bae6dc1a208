"""Everything one app instance wires together, in one plain object the routes reach through ``app.state``."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine as Database

from gateway.load_shedding import LoadShedder
from gateway.auth import Authenticator
from gateway.lifecycle import Lifecycle
from gateway.metrics import GatewayMetrics
from gateway.prompts import PromptEncoder
from gateway.ratelimit import RateLimiter
from gateway.settings import Settings
from gateway.tracing import Tracing
from gateway.usage_recorder import UsageRecorder


@dataclass
class Gateway:
    settings: Settings
    engine: Any  # engine.engine.Engine, or anything with its front (tests, benches)
    db: Database
    usage: UsageRecorder
    auth: Authenticator
    limiter: RateLimiter
    shedder: LoadShedder
    metrics: GatewayMetrics
    lifecycle: Lifecycle
    tracing: Tracing
    prompts: PromptEncoder
    # Request ids: 128 random bits from a generator seeded once from os.urandom, because
    # uuid4 reads os.urandom on every call, a syscall that is slow in sandboxes and on the 429 path.
    ids: random.Random = field(default_factory=random.Random)
    started_at: float = 0.0  # time.time() when the app started; the `created` of /v1/models entries
    database_ready: bool = True  # False from startup until the database answered and was set up
