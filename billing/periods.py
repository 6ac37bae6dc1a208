"""Budget periods: a calendar month in a time zone, or N days at a time from the day a budget was set.

Bounds are computed in the budget's time zone (so a month starts at local midnight of its
first day, daylight saving included) and returned as naive UTC, the ledger's time type.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from billing.errors import InvalidBudget

MAX_PERIOD_DAYS = 366
_DAYS = re.compile(r"^([1-9][0-9]{0,2})d$")


@dataclass(frozen=True)
class Period:
    start: datetime  # naive UTC, inclusive
    end: datetime  # naive UTC, exclusive

    def contains(self, moment: datetime) -> bool:
        return self.start <= moment < self.end


def check_period(spec: str) -> str:
    """``spec`` if it is "month" or "<N>d" with N in 1..366; else InvalidBudget."""
    if spec == "month":
        return spec
    m = _DAYS.match(spec) if isinstance(spec, str) else None
    if m is None or int(m.group(1)) > MAX_PERIOD_DAYS:
        raise InvalidBudget(f"period must be 'month' or a number of days like '7d' (at most {MAX_PERIOD_DAYS}), "
                            f"got {spec!r}")
    return spec


def zone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise InvalidBudget(f"unknown time zone {name!r} (an IANA name like 'UTC' or 'Europe/Paris')") from None


def period_at(spec: str, tz_name: str, anchored_at: datetime, moment: datetime) -> Period:
    """The period of a budget (``spec``, its zone and anchor, naive UTC) holding ``moment`` (naive UTC)."""
    tz = zone(tz_name)
    local = _local(moment, tz).date()
    if spec == "month":
        first = local.replace(day=1)
        following = (first + timedelta(days=32)).replace(day=1)
        return Period(_utc_midnight(first, tz), _utc_midnight(following, tz))
    days = int(check_period(spec)[:-1])
    anchor = _local(anchored_at, tz).date()
    k = (local - anchor).days // days
    first = anchor + timedelta(days=k * days)
    return Period(_utc_midnight(first, tz), _utc_midnight(first + timedelta(days=days), tz))


def day_starts(period: Period, tz_name: str) -> list[tuple[date, datetime]]:
    """Each local day of ``period``: (the day, its start as naive UTC)."""
    tz = zone(tz_name)
    day, last = _local(period.start, tz).date(), _local(period.end, tz).date()
    out = []
    while day < last:
        out.append((day, _utc_midnight(day, tz)))
        day += timedelta(days=1)
    return out


def _local(moment: datetime, tz: ZoneInfo) -> datetime:
    return moment.replace(tzinfo=UTC).astimezone(tz)


def _utc_midnight(day: date, tz: ZoneInfo) -> datetime:
    return datetime.combine(day, time(), tzinfo=tz).astimezone(UTC).replace(tzinfo=None)
