"""The tiergate CLI: each command does its job, and bad input is one line on stderr with a non-zero exit."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def tg(monkeypatch, database_url, capsys):
    monkeypatch.setenv("TIERGATE_DATABASE_URL", database_url)

    def run(*argv: str) -> tuple[int, str, str]:
        try:
            code = main(list(argv))
        except SystemExit as e:  # argparse's usage errors
            code = e.code
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


@pytest.fixture
def adapter_dir(tmp_path: Path) -> Path:
    d = tmp_path / "shout"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"r": 4, "base_model_name_or_path": "tiny"}))
    (d / "adapter_model.safetensors").write_bytes(b"")
    return d


def test_tenant_lifecycle(tg):
    assert tg("tenants", "create", "acme", "--tier", "premium", "--rpm", "10")[0] == 0
    assert tg("tenants", "set", "acme", "--tpm", "500", "--tier", "standard")[0] == 0
    code, out, _ = tg("tenants", "list")
    assert code == 0
    header, row = out.strip().splitlines()
    assert row.split() == ["acme", "standard", "10", "500", "8", "1", "20000000"]


def test_tenant_weight_is_set_by_create_and_set_and_listed(tg):
    code, out, _ = tg("tenants", "create", "heavy", "--tier", "standard", "--weight", "0.5")
    assert code == 0 and "weight 0.5" in out
    assert tg("tenants", "set", "heavy", "--weight", "3")[0] == 0
    header, row = tg("tenants", "list")[1].strip().splitlines()
    assert header.split()[-2] == "WEIGHT" and row.split()[-2] == "3"


def test_tenant_batch_queue_tokens_is_set_by_create_and_set_and_listed(tg):
    code, out, _ = tg("tenants", "create", "bulk", "--tier", "batch", "--batch-queue-tokens", "5000")
    assert code == 0 and "batch queue tokens 5000" in out
    assert tg("tenants", "set", "bulk", "--batch-queue-tokens", "3000000000")[0] == 0
    header, row = tg("tenants", "list")[1].strip().splitlines()
    assert header.split()[-1] == "BATCH_QUEUE_TOKENS" and row.split()[-1] == "3000000000"
    code, _, err = tg("tenants", "set", "bulk", "--batch-queue-tokens", "0")
    assert code != 0 and len(err.strip().splitlines()) == 1


def test_keys_create_prints_the_key_alone_on_stdout_and_revoke_works(tg, database_url):
    from billing.db import create_engine_for
    from billing.keys import authenticate

    tg("tenants", "create", "acme", "--tier", "premium")
    code, out, err = tg("keys", "create", "acme")
    secret = out.strip()
    assert code == 0 and out == secret + "\n" and "shown only this once" in err
    db = create_engine_for(database_url)
    assert authenticate(db, secret).tenant == "acme"
    key_id = secret.split("-")[1]
    assert tg("keys", "revoke", key_id)[0] == 0
    assert authenticate(db, secret) is None


def test_adapters_register_grant_list(tg, adapter_dir):
    tg("tenants", "create", "acme", "--tier", "premium")
    assert tg("adapters", "register", "shout", str(adapter_dir))[0] == 0
    assert tg("adapters", "grant", "shout", "acme")[0] == 0
    code, out, _ = tg("adapters", "list")
    assert code == 0 and out.splitlines()[1].split()[:3] == ["shout", "4", "acme"]


def test_report_formats(tg):
    code, out, _ = tg("report", "--from", "2026-01-01", "--to", "2026-01-02", "--format", "json")
    assert code == 0 and json.loads(out) == []
    code, out, _ = tg("report", "--from", "2026-01-01", "--to", "2026-01-02", "--format", "csv",
                      "--group-by", "tenant")
    assert code == 0 and out.startswith("bucket,")


@pytest.mark.parametrize(
    "argv",
    [
        ("tenants", "create", "acme", "--tier", "gold"),
        ("tenants", "create", "acme", "--tier", "premium", "--rpm", "-3"),
        ("tenants", "create", "acme"),
        ("tenants", "set", "nobody", "--rpm", "5"),
        ("tenants", "set", "acme"),
        ("tenants", "set", "acme", "--weight", "0"),
        ("tenants", "set", "acme", "--weight", "inf"),
        ("tenants", "create", "other", "--tier", "standard", "--weight", "lots"),
        ("keys", "create", "nobody"),
        ("keys", "revoke", "deadbeef"),
        ("adapters", "register", "x", "/does/not/exist"),
        ("adapters", "grant", "nothing", "acme"),
        ("report", "--from", "yesterday", "--to", "2026-01-02"),
        ("report", "--from", "2026-01-02", "--to", "2026-01-01"),
        ("report", "--from", "2026-01-01", "--to", "2026-01-02", "--group-by", "planet"),
        ("serve", "--port", "99999"),
        ("serve", "--device", "tpu"),
        ("serve", "--premium-ttft-slo", "0"),
        ("frobnicate",),
        (),
    ],
)
def test_bad_input_is_one_line_on_stderr_and_non_zero_exit(tg, argv):
    tg("tenants", "create", "acme", "--tier", "premium")
    code, out, err = tg(*argv)
    assert code != 0
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


def test_duplicate_tenant_is_refused(tg):
    tg("tenants", "create", "acme", "--tier", "premium")
    code, _, err = tg("tenants", "create", "acme", "--tier", "premium")
    assert code == 1 and "already exists" in err


def test_unmigrated_database_says_what_to_do(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("TIERGATE_DATABASE_URL", f"sqlite:///{tmp_path / 'empty.db'}")
    assert main(["tenants", "list"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "db upgrade" in err


def test_console_script_runs_db_upgrade_in_a_subprocess(tmp_path):
    exe = shutil.which("tiergate", path=str(Path(sys.executable).parent)) or None
    cmd = [exe] if exe else [sys.executable, "-m", "gateway.cli"]
    env = {"TIERGATE_DATABASE_URL": f"sqlite:///{tmp_path / 'sub.db'}", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([*cmd, "db", "upgrade"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    bad = subprocess.run([*cmd, "tenants", "create", "x", "--tier", "gold"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_settings_come_from_flags_then_environment_then_defaults():
    from gateway.settings import Settings, SettingsError, load_settings

    env = {"TIERGATE_PORT": "9001", "TIERGATE_MODEL": "/models/x", "TIERGATE_REDIS_URL": "redis://r:6379/0"}
    s = load_settings({"port": 9002, "model": None}, environ=env)
    assert (s.port, s.model, s.redis_url, s.device) == (9002, "/models/x", "redis://r:6379/0", Settings().device)
    with pytest.raises(SettingsError, match="TIERGATE_PORT"):
        load_settings(environ={"TIERGATE_PORT": "eighty"})
    with pytest.raises(SettingsError, match="policy"):
        load_settings(environ={"TIERGATE_SCHEDULER_POLICY": "random"})


def test_the_batch_tiers_margin_and_step_share_come_from_settings_into_the_scheduler():
    from gateway.server import engine_config
    from gateway.settings import SettingsError, load_settings

    settings = load_settings(environ={"TIERGATE_BATCH_KV_MARGIN": "0.2", "TIERGATE_BATCH_STEP_SHARE": "0.5"})
    config = engine_config(settings).scheduler_config(num_blocks=100, max_model_len=256)
    assert (config.spare_kv_margin, config.spare_step_share) == (0.2, 0.5)
    with pytest.raises(SettingsError, match="batch_kv_margin"):
        load_settings(environ={"TIERGATE_BATCH_KV_MARGIN": "1"})


def test_the_database_url_comes_from_the_environment_through_settings():
    from gateway.settings import SettingsError, load_settings

    assert load_settings(environ={"TIERGATE_DATABASE_URL": "postgresql://elsewhere/db"}).database_url == \
        "postgresql://elsewhere/db"
    assert load_settings(environ={}).database_url is None  # billing's SQLite file
    with pytest.raises(SettingsError, match="TIERGATE_EXPRESS_STEPS must be true or false"):
        load_settings(environ={"TIERGATE_EXPRESS_STEPS": "sometimes"})


def test_a_bad_environment_value_is_one_line_and_exit_1(monkeypatch, capsys):
    from gateway.cli import main

    monkeypatch.setenv("TIERGATE_DEBUG", "maybe")
    assert main(["tenants", "list"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["tiergate: error: TIERGATE_DEBUG must be true or false, not 'maybe'"]


def test_the_premium_slo_and_reserve_come_from_settings_into_the_engines_tiers():
    from gateway.server import tiers
    from gateway.settings import SettingsError, load_settings

    settings = load_settings({"premium_ttft_slo_s": 2.0},
                             environ={"TIERGATE_PREMIUM_KV_RESERVE": "0.25", "TIERGATE_PREMIUM_TTFT_SLO_S": "9"})
    premium, standard, batch = tiers(settings)
    assert (premium.name, premium.ttft_slo_s, premium.kv_reserve_fraction) == ("premium", 2.0, 0.25)
    assert (standard.name, standard.ttft_slo_s, standard.kv_reserve_fraction) == ("standard", None, 0.0)
    assert (batch.name, batch.ttft_slo_s, batch.spare_only) == ("batch", None, True)
    assert tiers(load_settings(environ={}))[0].ttft_slo_s == 2.0  # the CPU default
    assert tiers(load_settings(environ={"TIERGATE_DEVICE": "cuda"}))[0].ttft_slo_s == 0.5
    with pytest.raises(SettingsError, match="TIERGATE_PREMIUM_TTFT_SLO_S"):
        load_settings(environ={"TIERGATE_PREMIUM_TTFT_SLO_S": "soon"})
    with pytest.raises(SettingsError, match="premium_kv_reserve"):
        load_settings(environ={"TIERGATE_PREMIUM_KV_RESERVE": "1.5"})


def test_the_adapters_dtype_comes_from_the_flag_or_environment_into_the_engine_config():
    from gateway.cli import build_parser, _settings
    from gateway.server import engine_config
    from gateway.settings import SettingsError, load_settings

    assert engine_config(load_settings(environ={})).lora_dtype is None  # the engine decides
    assert engine_config(load_settings(environ={"TIERGATE_LORA_DTYPE": "float32"})).lora_dtype == "float32"
    args = build_parser().parse_args(["serve", "--lora-dtype", "bfloat16"])
    assert engine_config(_settings(args)).lora_dtype == "bfloat16"
    with pytest.raises(SettingsError, match="lora_dtype"):
        load_settings(environ={"TIERGATE_LORA_DTYPE": "int8"})


def test_the_prompt_bounds_walk_over_the_vocabulary_is_done_at_startup_not_on_a_requests_event_loop(
        tiny_model_dir, database_url):
    from gateway.server import build
    from gateway.settings import load_settings

    built = build(load_settings(environ={"TIERGATE_MODEL": f"dummy:{tiny_model_dir}",
                                         "TIERGATE_DATABASE_URL": database_url}), migrate=False)
    try:
        assert "max_token_chars" in vars(built.engine.tokenizer)  # the cached property is already computed
    finally:
        built.engine.shutdown()
        built.db.dispose()
