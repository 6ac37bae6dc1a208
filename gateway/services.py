"""Everything one app instance wires together, in one plain object the routes reach through ``app.state``."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from sqlalchemy import Engine as Database

from engine.events import Listener
from engine.request import Delta, EngineRequest
from scheduler import TierLoad

from gateway.load_shedding import LoadShedder
from gateway.auth import Authenticator
from gateway.budget_gate import BudgetGate
from gateway.tenant_slots import TenantSlots
from gateway.lifecycle import Lifecycle
from gateway.metrics import GatewayMetrics
from gateway.prompts import PromptEncoder
from gateway.ratelimit import RateLimiter
from gateway.settings import Settings
from gateway.tracing import Tracing
from gateway.usage_recorder import UsageRecorder

if TYPE_CHECKING:  # torch comes with these; a gateway module is imported by commands that never serve
    from engine.config import EngineConfig
    from engine.grammar_compiler import GrammarCompiler
    from engine.tokenizer import TextTokenizer


class BatchWaker(Protocol):
    """What a request handler asks of the Batch API's driver (gateway/batch_driver.py), which imports this module."""

    def wake(self) -> None:
        """Look for lines to run now, not at the next poll."""


class EngineFront(Protocol):
    """What the gateway needs of the engine: engine.engine.Engine, or a stand-in (tests, benches)."""

    model_name: str
    max_model_len: int
    config: EngineConfig  # its tiers
    tokenizer: TextTokenizer
    grammars: GrammarCompiler

    @property
    def is_running(self) -> bool: ...
    def start(self) -> object: ...
    def shutdown(self, timeout: float = ...) -> None: ...
    def add_listener(self, listener: Listener) -> None: ...
    def check(self, request: EngineRequest) -> None: ...
    def submit(self, request: EngineRequest) -> AsyncIterator[Delta]: ...
    def abort(self, request_id: str) -> None: ...
    def load(self) -> dict[str, TierLoad]: ...
    def kv_usage(self) -> tuple[dict[str, int], int]: ...
    def fair_share_spread(self) -> dict[str, float]: ...
    def adapter_usage(self) -> tuple[frozenset[str], frozenset[str]]: ...
    def list_adapters(self) -> list[str]: ...
    def register_adapter(self, name: str, path: str) -> None: ...
    def unregister_adapter(self, name: str, timeout: float = ...) -> None: ...


@dataclass
class Gateway:
    settings: Settings
    engine: EngineFront
    db: Database
    usage: UsageRecorder
    auth: Authenticator
    limiter: RateLimiter
    shedder: LoadShedder
    metrics: GatewayMetrics
    lifecycle: Lifecycle
    tracing: Tracing
    prompts: PromptEncoder
    grammar_slots: TenantSlots = field(default_factory=TenantSlots)  # grammars each tenant is compiling
    # Requests each tenant has between its key and its admission (gateway/completions.py)
    reading_slots: TenantSlots = field(default_factory=TenantSlots)
    # Request ids: 128 random bits from a generator seeded once from os.urandom, because
    # uuid4 reads os.urandom on every call, a syscall that is slow in sandboxes and on the 429 path.
    ids: random.Random = field(default_factory=random.Random)
    started_at: float = 0.0  # time.time() when the app started; the `created` of /v1/models entries
    database_ready: bool = True  # False from startup until the database answered and was set up
    budgets: BudgetGate | None = None  # tenants' spend limits (gateway/budget_gate.py); None: not enforced
    batch_driver: BatchWaker | None = None  # runs the Batch API's lines (gateway/batch_driver.py)
