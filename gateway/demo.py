"""``tiergate serve --demo``: demo tenants with fresh keys, the demo adapters registered and granted, a curl to paste.

Idempotent: run it on every start; what exists is kept, and each start prints
new keys (the old ones stay valid) because a key cannot be shown twice.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import Engine as Database

from billing import adapters as billing_adapters
from billing import keys as billing_keys
from billing import tenants as billing_tenants
from gateway.adapter_dirs import AdapterDirError, read_adapter_dir
from lora_pool.demo_adapters import DEMO_ADAPTERS_DIR, demo_adapters

DEMO_TENANTS = (("acme", "premium"), ("globex", "standard"))


@dataclass
class DemoSetup:
    keys: dict[str, str] = field(default_factory=dict)  # tenant -> secret
    adapters: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # "name: why"
    admin_token: str | None = None


def set_up_demo(db: Database, adapters_root: Path = DEMO_ADAPTERS_DIR) -> DemoSetup:
    setup = DemoSetup()
    existing = {t.name for t in billing_tenants.list_tenants(db)}
    for name, tier in DEMO_TENANTS:
        if name not in existing:
            billing_tenants.create_tenant(db, name, tier)
        setup.keys[name] = billing_keys.create_key(db, name)[1]
    registered = {a.name: a for a in billing_adapters.list_adapters(db)}
    for name, path in demo_adapters(adapters_root).items():
        if name not in registered:
            try:
                found = read_adapter_dir(str(path))
            except AdapterDirError as e:
                setup.skipped.append(f"{name}: {e}")
                continue
            billing_adapters.register_adapter(db, name, found.path, found.base_model, found.rank)
        for tenant, _ in DEMO_TENANTS:
            billing_adapters.grant(db, name, tenant)
        setup.adapters.append(name)
    return setup


def demo_admin_token() -> str:
    return "tg-admin-" + secrets.token_urlsafe(16)


def banner(setup: DemoSetup, host: str, port: int, model_name: str, loaded: list[str]) -> str:
    base = f"http://{host}:{port}"
    lines = ["", "tiergate demo", ""]
    for tenant, tier in DEMO_TENANTS:
        lines.append(f"  {tenant:<7} ({tier:<8}) key: {setup.keys[tenant]}")
    served = [a for a in setup.adapters if a in loaded]
    lines.append(f"  base model: {model_name}")
    lines.append(f"  adapters:   {', '.join(served) if served else '(none)'}")
    for s in setup.skipped:
        lines.append(f"  skipped adapter {s}")
    if setup.admin_token:
        lines.append(f"  admin token: {setup.admin_token}")
    model = served[0] if served else model_name
    # The bundled Q4_1 file answers the capital question with a list in French when greedy (llama.cpp on the
    # same file too); the first demo adapter, `french`, answers it as asked.
    question = "What is the capital of France?" if served else "Name three colors."
    lines += [
        "",
        "Try:",
        f"  curl {base}/v1/chat/completions \\",
        f"    -H 'Authorization: Bearer {setup.keys['acme']}' -H 'Content-Type: application/json' \\",
        f"    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"{question}\"}}], "
        "\"max_tokens\": 32}'",
        "",
    ]
    return "\n".join(lines)
