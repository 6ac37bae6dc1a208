"""Trace files: one JSON object per line, replayed as recorded.

Each line: {"timestamp": seconds, "tenant": name, "adapter": name or null,
"prompt_tokens": int, "output_tokens": int}. Timestamps may start anywhere;
replay keeps the gaps between them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class TraceRecord:
    timestamp: float
    tenant: str
    adapter: str | None
    prompt_tokens: int
    output_tokens: int


def _parse(line: str, lineno: int) -> TraceRecord:
    try:
        raw = json.loads(line)
        record = TraceRecord(
            timestamp=float(raw["timestamp"]),
            tenant=str(raw["tenant"]),
            adapter=raw.get("adapter") or None,
            prompt_tokens=int(raw["prompt_tokens"]),
            output_tokens=int(raw["output_tokens"]),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"trace line {lineno}: {exc!r}") from None
    if record.prompt_tokens < 1 or record.output_tokens < 1:
        raise ValueError(f"trace line {lineno}: token counts must be positive")
    return record


def read_trace(path: Path) -> list[TraceRecord]:
    """The records of ``path`` in time order, times shifted to start at 0."""
    records = [
        _parse(line, lineno)
        for lineno, line in enumerate(Path(path).read_text().splitlines(), 1)
        if line.strip()
    ]
    if not records:
        raise ValueError(f"{path} holds no trace records")
    records.sort(key=lambda r: r.timestamp)
    start = records[0].timestamp
    return [TraceRecord(r.timestamp - start, r.tenant, r.adapter, r.prompt_tokens, r.output_tokens) for r in records]


def write_trace(path: Path, records: list[TraceRecord]) -> None:
    Path(path).write_text("".join(json.dumps(asdict(r)) + "\n" for r in records))
