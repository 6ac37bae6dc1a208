"""Soft-threshold warnings of budgets: a log line, and an optional webhook POSTed off the request path.

The webhook gets a JSON body per warning; deliveries wait in a bounded queue and are tried a
few times with growing pauses by one background task, so a slow or dead receiver never
delays a request and never grows memory: past the queue's bound a warning is logged and
dropped from the webhook (its log line and metric stand).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

log = logging.getLogger(__name__)

QUEUE_BOUND = 100
ATTEMPTS = 4
FIRST_PAUSE_S = 0.5
TIMEOUT_S = 5.0


class WebhookNotifier:
    def __init__(self, url: str | None, attempts: int = ATTEMPTS, first_pause_s: float = FIRST_PAUSE_S,
                 timeout_s: float = TIMEOUT_S) -> None:
        self.url = url
        self.attempts = attempts
        self.first_pause_s = first_pause_s
        self.timeout_s = timeout_s
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(QUEUE_BOUND)
        self.delivered = 0
        self.dropped = 0

    def notify(self, payload: dict[str, Any]) -> None:
        """Queue ``payload`` for the webhook, if one is configured; never blocks."""
        if self.url is None:
            return
        try:
            self.queue.put_nowait(payload)
        except asyncio.QueueFull:
            self.dropped += 1
            log.warning("budget webhook: queue full, warning for %s not sent", payload.get("tenant"))

    async def run(self) -> None:
        """Until cancelled: deliver queued warnings, each tried up to ``attempts`` times."""
        if self.url is None:
            return
        async with httpx.AsyncClient(timeout=self.timeout_s) as client:
            while True:
                payload = await self.queue.get()
                await self._deliver(client, payload)

    async def _deliver(self, client: httpx.AsyncClient, payload: dict[str, Any]) -> None:
        pause = self.first_pause_s
        for attempt in range(1, self.attempts + 1):
            try:
                response = await client.post(self.url, json=payload)
                if response.status_code < 300:
                    self.delivered += 1
                    return
                problem = f"HTTP {response.status_code}"
            except httpx.HTTPError as e:
                problem = f"{type(e).__name__}: {e}"
            if attempt < self.attempts:
                await asyncio.sleep(pause)
                pause *= 2
        self.dropped += 1
        log.warning("budget webhook: gave up on a warning for %s after %d attempts (%s)",
                    payload.get("tenant"), self.attempts, problem)
