"""Batch API metrics, in the app's registry: lines by state and batches by status (the database's counts, as
every replica sees them, refreshed by the batch driver), and batches created by outcome."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from billing.batch_models import BATCH_STATUSES, LINE_STATES


class BatchMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.lines = Gauge("tiergate_batch_lines", "Batch lines in the database by state.", ["state"],
                           registry=registry)
        self.batches = Gauge("tiergate_batches", "Batches in the database by status.", ["status"], registry=registry)
        self.created = Counter("tiergate_batches_created", "Batches by the status creation or validation gave them "
                               "(validating; then in_progress, or failed: invalid lines or past the queue limit; "
                               "refused: a 429 at creation, the tenant's queue limit full).", ["status"],
                               registry=registry)
        self.running = Gauge("tiergate_batch_lines_running", "Batch lines this replica is running.",
                             registry=registry)
        for state in LINE_STATES:
            self.lines.labels(state)
        for status in BATCH_STATUSES:
            self.batches.labels(status)

    def count_created(self, status: str) -> None:
        self.created.labels(status).inc()

    def observe(self, lines: dict[str, int], batches: dict[str, int]) -> None:
        for state in LINE_STATES:
            self.lines.labels(state).set(lines.get(state, 0))
        for status in BATCH_STATUSES:
            self.batches.labels(status).set(batches.get(status, 0))
