"""LoRA adapters known to the gateway and which tenants may use them."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Engine, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from billing.errors import DuplicateAdapter, InvalidAdapter, UnknownAdapter, UnknownGrant
from billing.models import Adapter, AdapterGrant, find_named
from billing.tenants import find_tenant, touch


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    path: str
    base_model: str
    rank: int
    tenants: tuple[str, ...]  # tenants granted the adapter, sorted


def register_adapter(engine: Engine, name: str, path: str, base_model: str, rank: int) -> AdapterInfo:
    if not name or len(name) > 128 or not name.isprintable():
        raise InvalidAdapter(f"adapter name must be 1 to 128 printable characters, got {name!r}")
    if not path:
        raise InvalidAdapter(f"adapter {name!r} needs a path")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise InvalidAdapter(f"adapter rank must be a positive integer, got {rank!r}")
    with Session(engine) as session:
        session.add(Adapter(name=name, path=path, base_model=base_model, rank=rank))
        try:
            session.commit()
        except IntegrityError:
            raise DuplicateAdapter(f"adapter {name!r} already exists") from None
    return AdapterInfo(name, path, base_model, rank, ())


def list_adapters(engine: Engine) -> list[AdapterInfo]:
    with Session(engine) as session:
        return [_info(a) for a in session.scalars(select(Adapter).order_by(Adapter.name))]


def grant(engine: Engine, adapter: str, tenant: str) -> None:
    """Let `tenant` use `adapter`; granting twice is a no-op."""
    with Session(engine) as session:
        a, t = _find_adapter(session, adapter), find_tenant(session, tenant)
        if session.get(AdapterGrant, (a.id, t.id)) is None:
            session.add(AdapterGrant(adapter_id=a.id, tenant_id=t.id))
            touch(t)
            session.commit()


def revoke_grant(engine: Engine, adapter: str, tenant: str) -> None:
    with Session(engine) as session:
        a, t = _find_adapter(session, adapter), find_tenant(session, tenant)
        existing = session.get(AdapterGrant, (a.id, t.id))
        if existing is None:
            raise UnknownGrant(f"tenant {tenant!r} has no grant for adapter {adapter!r}")
        session.delete(existing)
        touch(t)
        session.commit()


def _find_adapter(session: Session, name: str) -> Adapter:
    return find_named(session, Adapter, name, UnknownAdapter)


def _info(a: Adapter) -> AdapterInfo:
    tenants = tuple(sorted(g.tenant.name for g in a.grants))
    return AdapterInfo(a.name, a.path, a.base_model, a.rank, tenants)
