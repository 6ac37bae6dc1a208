"""``tiergate budgets set|list|delete`` and ``tiergate prices set|list`` (parsers and commands for gateway/cli.py)."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime

from gateway.settings import Settings


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number zero or more, got {text!r}")
    return value


def moment(text: str) -> datetime:
    try:
        value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an ISO date or datetime like 2026-12-01, got {text!r}") from None
    return value.astimezone(UTC).replace(tzinfo=None) if value.tzinfo else value


def add_parsers(sub, positive_float, positive_int) -> None:
    b = sub.add_parser("budgets", help="tenants' spend limits per period").add_subparsers(
        dest="action", required=True, metavar="ACTION")
    bs = b.add_parser("set", help="set a tenant's budget in one unit (replaces its budget in that unit)")
    bs.add_argument("tenant")
    limit = bs.add_mutually_exclusive_group(required=True)
    limit.add_argument("--gpu-seconds", type=positive_float)
    limit.add_argument("--tokens", type=positive_int)
    limit.add_argument("--usd", type=positive_float)
    bs.add_argument("--period", default="month", help="'month' (calendar, in --timezone) or N days like '7d'")
    bs.add_argument("--soft", type=positive_float, default=0.8, help="warn past this fraction of the limit")
    bs.add_argument("--timezone", default="UTC", help="IANA zone of the period's bounds (default UTC)")
    b.add_parser("list", help="list budgets with their current spend").add_argument("tenant", nargs="?")
    bd = b.add_parser("delete", help="remove a tenant's budget in one unit")
    bd.add_argument("tenant")
    bd.add_argument("--unit", required=True, choices=["tokens", "gpu_seconds", "usd"])

    p = sub.add_parser("prices", help="prices per tier").add_subparsers(dest="action", required=True, metavar="ACTION")
    ps = p.add_parser("set", help="set a tier's prices from a few seconds from now (or --from a later moment)")
    ps.add_argument("tier")
    ps.add_argument("--per-gpu-second", type=non_negative_float, required=True)
    ps.add_argument("--per-million-prompt-tokens", type=non_negative_float, required=True)
    ps.add_argument("--per-million-completion-tokens", type=non_negative_float, required=True)
    ps.add_argument("--from", dest="effective_from", type=moment, help="when they take effect (default now)")
    p.add_parser("list", help="every tier's prices: past, current and scheduled")


def cmd_budgets(args: argparse.Namespace, settings: Settings, db, table) -> None:
    from billing import budgets
    from billing.models import utcnow
    from billing.prices import load_price_book

    if args.action == "set":
        unit, limit = next((u, v) for u in ("gpu_seconds", "tokens", "usd") if (v := getattr(args, u)) is not None)
        b = budgets.set_budget(db, args.tenant, unit, limit, args.period, args.soft, args.timezone)
        print(f"budget of {b.tenant}: {b.limit:g} {b.unit} per {b.period} ({b.timezone}), warning at "
              f"{100 * b.soft:g}%; every replica enforces it within {settings.budget_poll_s:g} s")
    elif args.action == "delete":
        budgets.delete_budget(db, args.tenant, args.unit)
        print(f"removed the {args.unit} budget of {args.tenant}")
    else:
        prices, now = load_price_book(db), utcnow()
        rows = []
        for b in budgets.list_budgets(db, args.tenant):
            u = budgets.budget_usage(db, b, prices, now)
            rows.append((b.tenant, b.unit, f"{b.limit:g}", f"{u.spent:.6g}", f"{u.left:.6g}", b.period, b.timezone,
                         f"{b.soft:g}", u.period.start.isoformat(), u.period.end.isoformat()))
        print(table(("TENANT", "UNIT", "LIMIT", "SPENT", "LEFT", "PERIOD", "TIMEZONE", "SOFT", "PERIOD_START",
                     "PERIOD_END"), rows))


def cmd_prices(args: argparse.Namespace, settings: Settings, db, table) -> None:
    from billing.prices import load_price_book, set_price

    if args.action == "set":
        p = set_price(db, args.tier, args.per_gpu_second, args.per_million_prompt_tokens,
                      args.per_million_completion_tokens, args.effective_from)
        print(f"prices of {p.tier} from {p.effective_from.isoformat()}Z: {p.per_gpu_second:g} per GPU-second, "
              f"{p.per_million_prompt_tokens:g} per million prompt tokens, {p.per_million_completion_tokens:g} per "
              "million completion tokens")
    else:
        rows = [(p.tier, p.effective_from.isoformat(), f"{p.per_gpu_second:g}", f"{p.per_million_prompt_tokens:g}",
                 f"{p.per_million_completion_tokens:g}") for p in load_price_book(db).history()]
        print(table(("TIER", "FROM", "PER_GPU_SECOND", "PER_M_PROMPT", "PER_M_COMPLETION"), rows))
