"""Adapters through the gateway: register, grant, load and unload at run time; others' adapters stay invisible."""

from __future__ import annotations

import httpx
import openai
import pytest

ADMIN = {"authorization": "Bearer test-admin-token"}


@pytest.fixture
def lora_server(serve, make_engine):
    live = serve(engine=make_engine(max_loras=2))
    live.add_tenant("acme", "premium", rpm=10_000, tpm=10_000_000, max_concurrent=100)
    live.add_tenant("globex", "standard", rpm=10_000, tpm=10_000_000, max_concurrent=100)
    return live


def models_of(server, tenant: str) -> list[str]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.keys[tenant])
    return [m.id for m in client.models.list().data]


def complete(server, tenant: str, model: str) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", headers={"authorization": f"Bearer {server.keys[tenant]}"},
                      json={"model": model, "prompt": "abc", "max_tokens": 4, "temperature": 0}, timeout=60)


def test_registered_and_granted_adapter_serves_only_its_tenant(lora_server, tiny_adapter_dir):
    s = lora_server
    r = httpx.post(s.url + "/admin/adapters", json={"name": "shout", "path": str(tiny_adapter_dir)}, headers=ADMIN)
    assert r.status_code == 201, r.text
    assert r.json()["loaded"] and r.json()["rank"] == 4
    assert httpx.post(s.url + "/admin/adapters/shout/grants", json={"tenant": "acme"}, headers=ADMIN).status_code == 201

    assert models_of(s, "acme") == [s.engine.model_name, "shout"]
    assert models_of(s, "globex") == [s.engine.model_name]
    with_adapter = complete(s, "acme", "shout")
    assert with_adapter.status_code == 200 and with_adapter.json()["model"] == "shout"
    hidden = complete(s, "globex", "shout")
    assert hidden.status_code == 404 and hidden.json()["error"]["code"] == "model_not_found"
    # The same 404 as for a name that does not exist at all.
    assert complete(s, "globex", "no-such-adapter").json()["error"]["message"].replace("no-such-adapter", "shout") \
        == hidden.json()["error"]["message"]


def test_unloaded_adapter_is_not_served_until_loaded_again(lora_server, tiny_adapter_dir):
    s = lora_server
    httpx.post(s.url + "/admin/adapters", json={"name": "shout", "path": str(tiny_adapter_dir)}, headers=ADMIN)
    httpx.post(s.url + "/admin/adapters/shout/grants", json={"tenant": "acme"}, headers=ADMIN)
    assert httpx.post(s.url + "/admin/adapters/shout/unload", headers=ADMIN).json()["loaded"] is False
    assert complete(s, "acme", "shout").status_code == 404
    assert httpx.post(s.url + "/admin/adapters/shout/load", headers=ADMIN).json()["loaded"] is True
    assert complete(s, "acme", "shout").status_code == 200
    listed = httpx.get(s.url + "/admin/adapters", headers=ADMIN).json()["data"]
    assert [(a["name"], a["tenants"], a["loaded"]) for a in listed] == [("shout", ["acme"], True)]


def test_adapter_the_engine_refuses_is_not_registered(lora_server, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text('{"r": 4, "target_modules": ["q_proj"], "peft_type": "LORA"}')
    (bad / "adapter_model.safetensors").write_bytes(b"not safetensors")
    r = httpx.post(lora_server.url + "/admin/adapters", json={"name": "bad", "path": str(bad)}, headers=ADMIN)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_adapter"
    assert httpx.get(lora_server.url + "/admin/adapters", headers=ADMIN).json()["data"] == []


def test_demo_setup_is_idempotent_and_grants_every_demo_adapter(database_url, tiny_adapter_dir):
    from billing.adapters import list_adapters
    from billing.db import create_engine_for
    from gateway.demo import set_up_demo

    db = create_engine_for(database_url)
    root = tiny_adapter_dir.parent
    first = set_up_demo(db, root)
    second = set_up_demo(db, root)
    assert first.adapters == second.adapters == ["shout"]
    assert first.keys["acme"] != second.keys["acme"]  # a fresh key each start; keys are shown once
    [adapter] = list_adapters(db)
    assert adapter.tenants == ("acme", "globex")
