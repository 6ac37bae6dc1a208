"""Renderers of usage reports: an aligned text table, CSV and JSON."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict, fields

from billing.errors import InvalidReport
from billing.reports import ReportRow

FORMATS = ("table", "csv", "json")
COLUMNS = [f.name for f in fields(ReportRow)]


def render(rows: list[ReportRow], fmt: str) -> str:
    if fmt == "table":
        return render_table(rows)
    if fmt == "csv":
        return render_csv(rows)
    if fmt == "json":
        return render_json(rows)
    raise InvalidReport(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")


def as_dicts(rows: list[ReportRow]) -> list[dict]:
    """Rows as JSON-ready dicts (ISO bucket, rounded seconds and cost)."""
    return [
        {
            **asdict(r),
            "bucket": r.bucket.isoformat(),
            "gpu_seconds": round(r.gpu_seconds, 6),
            "recompute_gpu_seconds": round(r.recompute_gpu_seconds, 6),
            "queue_seconds": round(r.queue_seconds, 6),
            "cost": round(r.cost, 6),
            "gpu_usd": round(r.gpu_usd, 6),
            "token_usd": round(r.token_usd, 6),
            "usd": round(r.usd, 6),
        }
        for r in rows
    ]


def render_json(rows: list[ReportRow]) -> str:
    return json.dumps(as_dicts(rows), indent=2)


def render_csv(rows: list[ReportRow]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(as_dicts(rows))
    return out.getvalue()


def render_table(rows: list[ReportRow]) -> str:
    cells = [COLUMNS] + [
        [
            r.bucket.strftime("%Y-%m-%d %H:%M"),
            "-" if r.group is None else r.group,
            str(r.requests),
            str(r.rejected),
            str(r.prompt_tokens),
            str(r.completion_tokens),
            f"{r.gpu_seconds:.3f}",
            f"{r.recompute_gpu_seconds:.3f}",
            f"{r.queue_seconds:.3f}",
            f"{r.cost:.4f}",
            f"{r.gpu_usd:.4f}",
            f"{r.token_usd:.4f}",
            f"{r.usd:.4f}",
        ]
        for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    # Text columns left-aligned, numbers right-aligned.
    lines = [
        "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in cells
    ]
    return "\n".join(lines) + "\n"
