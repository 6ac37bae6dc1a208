"""The ``tiergate`` command: serve, db, tenants, keys, adapters, report, budgets, prices.

Every command that fails on bad input prints one line on stderr and exits
non-zero, never a traceback: scripts check the exit code, people read the line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from datetime import date, datetime
from typing import NoReturn

from sqlalchemy.exc import SQLAlchemyError

from billing.errors import BillingError
from billing.tenants import TIERS
from gateway import budget_cli
from gateway.adapter_dirs import AdapterDirError
from gateway.settings import Settings, SettingsError, load_settings
from tiergate_common.env import DEBUG, EnvError
from tiergate_common.errors import first_line


class CommandError(Exception):
    """A failure to report as one line and exit code 1."""


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse prints the whole usage first; one line naming the problem is what we promise.
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def port_number(text: str) -> int:
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"port must be at most 65535, got {text!r}")
    return value


def day(text: str) -> date | datetime:
    try:
        return datetime.fromisoformat(text) if "T" in text or " " in text else date.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a date like 2026-01-31, got {text!r}") from None


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="tiergate", description="Multi-tenant LLM gateway with tiered SLO scheduling.")
    p.add_argument("--database-url", help="SQLAlchemy URL (default: TIERGATE_DATABASE_URL or ./var/tiergate.db)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("serve", help="run the OpenAI-compatible server")
    s.add_argument("--model", help="model directory, .gguf file, or 'bundled' (default)")
    s.add_argument("--device", choices=["cpu", "cuda"])
    s.add_argument("--dtype", choices=["float32", "bfloat16"],
                   help="float32 (exact parity with HF; a GGUF is then dequantized) or bfloat16 (CPUs with native "
                        "bf16 only). Unset on CPU: float32, a GGUF served in its own quantization")
    s.add_argument("--quantize", choices=["q8_0", "q4_0", "q4_k"],
                   help="HF checkpoints: quantize the projections at load (CPU); a GGUF is served in its own "
                        "quantization")
    s.add_argument("--lora-dtype", choices=["float32", "bfloat16"],
                   help="the adapters' weights (default: bfloat16 on CPU over a quantized model, else the "
                        "model's dtype)")
    s.add_argument("--kv-cache-memory", metavar="SIZE",
                   help="KV pool size, e.g. 512MiB or 2GB (default: half the memory left after the weights, "
                        "capped at a quarter context per batch slot)")
    s.add_argument("--kv-cache-tokens", type=positive_int, metavar="N", help="KV pool size in tokens")
    s.add_argument("--kv-cache-dtype", choices=["auto", "q8_0"],
                   help="the KV pool's format: auto (the model's dtype, default) or q8_0 (8 bits a value and a "
                        "scale per 32, about a quarter of float32's bytes; CPU, head sizes a multiple of 32)")
    s.add_argument("--speculative", choices=["ngram", "draft"],
                   help="speculative decoding: 'ngram' drafts each row's next tokens from its own prompt and output "
                        "(prompt lookup), 'draft' with the small model --draft-model; off by default")
    s.add_argument("--draft-model", metavar="DIR",
                   help="--speculative draft: the draft model (HF directory or .gguf), with the model's tokenizer")
    s.add_argument("--draft-kv-blocks", type=positive_int, metavar="N",
                   help="the draft model's own KV pool in blocks (default: as many tokens as the model's pool)")
    s.add_argument("--num-speculative-tokens", type=positive_int, metavar="K",
                   help="the most tokens a row drafts per step (default 4, at most 16)")
    s.add_argument("--host")
    s.add_argument("--port", type=port_number)
    s.add_argument("--policy", choices=["tiered", "fcfs"], dest="scheduler_policy")
    s.add_argument("--premium-ttft-slo", type=positive_float, dest="premium_ttft_slo_s", metavar="SECONDS",
                   help="premium tier's time-to-first-token SLO (default 0.5 on a GPU, 2 on a CPU)")
    s.add_argument("--demo", action="store_true", help="create demo tenants, keys and adapters, then serve")

    db = sub.add_parser("db", help="database schema").add_subparsers(dest="action", required=True, metavar="ACTION")
    db.add_parser("upgrade", help="apply every migration")

    t = sub.add_parser("tenants", help="tenants and their limits").add_subparsers(dest="action", required=True,
                                                                                  metavar="ACTION")
    tc = t.add_parser("create", help="create a tenant")
    tc.add_argument("name")
    tc.add_argument("--tier", required=True, choices=TIERS)
    t.add_parser("list", help="list tenants")
    ts = t.add_parser("set", help="change a tenant's tier or limits")
    ts.add_argument("name")
    ts.add_argument("--tier", choices=TIERS)
    for parser in (tc, ts):
        parser.add_argument("--rpm", type=positive_int)
        parser.add_argument("--tpm", type=positive_int)
        parser.add_argument("--max-concurrent", type=positive_int,
                            help="sequences in flight at once (n choices of each prompt count one each)")
        parser.add_argument("--weight", type=positive_float,
                            help="share of the tier's engine time relative to its other tenants (default 1)")
        parser.add_argument("--batch-queue-tokens", type=positive_int,
                            help="tokens (prompts plus max_tokens) its unfinished batches may hold (default 20000000)")

    k = sub.add_parser("keys", help="API keys").add_subparsers(dest="action", required=True, metavar="ACTION")
    k.add_parser("create", help="create a key; prints it once, alone on stdout").add_argument("tenant")
    k.add_parser("revoke", help="revoke a key by its id").add_argument("key_id")

    a = sub.add_parser("adapters", help="LoRA adapters").add_subparsers(dest="action", required=True,
                                                                        metavar="ACTION")
    ar = a.add_parser("register", help="register a peft adapter directory")
    ar.add_argument("name")
    ar.add_argument("path")
    ag = a.add_parser("grant", help="let a tenant use an adapter")
    ag.add_argument("name")
    ag.add_argument("tenant")
    a.add_parser("list", help="list adapters and their grants")

    r = sub.add_parser("report", help="usage report from the ledger")
    r.add_argument("--from", dest="start", type=day, required=True)
    r.add_argument("--to", dest="end", type=day, required=True)
    r.add_argument("--group-by", choices=["tier", "tenant", "adapter"], default="tier")
    r.add_argument("--format", choices=["table", "csv", "json"], default="table")
    r.add_argument("--bucket", choices=["hour", "day"], default="day")
    budget_cli.add_parsers(sub, positive_float, positive_int)
    return p


def _settings(args: argparse.Namespace) -> Settings:
    names = ("database_url", "model", "device", "dtype", "host", "port", "scheduler_policy", "premium_ttft_slo_s",
             "quantize", "kv_cache_memory", "kv_cache_tokens", "kv_cache_dtype", "speculative",
             "num_speculative_tokens", "draft_model", "draft_kv_blocks", "lora_dtype")
    return load_settings({n: getattr(args, n, None) for n in names})


def _db(settings: Settings):
    from billing.db import create_engine_for

    return create_engine_for(settings.database_url)


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [list(header)] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def cmd_serve(args: argparse.Namespace, settings: Settings) -> None:
    from dataclasses import replace

    from gateway import demo
    from gateway.app import load_registered_adapters
    from gateway.logs import configure_logging
    from gateway.server import build, serve

    configure_logging(settings.log_level)
    seed = None
    if args.demo:
        if not settings.admin_token:
            settings = replace(settings, admin_token=demo.demo_admin_token())
        admin_token = settings.admin_token

        def seed(db, engine) -> None:  # once the database answers, after its migrations
            setup = demo.set_up_demo(db)
            setup.admin_token = admin_token
            load_registered_adapters(db, engine)
            print(demo.banner(setup, settings.host, settings.port, engine.model_name, engine.list_adapters()),
                  flush=True)

    serve(settings, build(settings, seed=seed))


def cmd_db(args: argparse.Namespace, settings: Settings) -> None:
    from billing.db import upgrade

    upgrade(settings.database_url)
    print("database is at the latest schema", file=sys.stderr)


def cmd_tenants(args: argparse.Namespace, settings: Settings) -> None:
    from billing import tenants

    db = _db(settings)
    limits = {k: getattr(args, k, None) for k in ("rpm", "tpm", "max_concurrent", "weight", "batch_queue_tokens")}
    limits = {k: v for k, v in limits.items() if v is not None}
    if args.action == "create":
        t = tenants.create_tenant(db, args.name, args.tier, **limits)
        print(f"created tenant {t.name} ({t.tier}, rpm {t.rpm}, tpm {t.tpm}, max concurrent {t.max_concurrent}, "
              f"weight {t.weight:g}, batch queue tokens {t.batch_queue_tokens})")
    elif args.action == "list":
        rows = [(t.name, t.tier, t.rpm, t.tpm, t.max_concurrent, f"{t.weight:g}", t.batch_queue_tokens)
                for t in tenants.list_tenants(db)]
        print(_table(("NAME", "TIER", "RPM", "TPM", "MAX_CONCURRENT", "WEIGHT", "BATCH_QUEUE_TOKENS"), rows))
    else:
        changes = {**limits, **({"tier": args.tier} if args.tier else {})}
        if not changes:
            raise CommandError("nothing to change: give --tier, --rpm, --tpm, --max-concurrent, --weight or "
                               "--batch-queue-tokens")
        t = tenants.set_tenant(db, args.name, **changes)
        print(f"tenant {t.name}: {t.tier}, rpm {t.rpm}, tpm {t.tpm}, max concurrent {t.max_concurrent}, "
              f"weight {t.weight:g}, batch queue tokens {t.batch_queue_tokens}")


def cmd_keys(args: argparse.Namespace, settings: Settings) -> None:
    from billing import keys

    db = _db(settings)
    if args.action == "create":
        key_id, secret = keys.create_key(db, args.tenant)
        print(secret)  # alone on stdout, so `KEY=$(tiergate keys create acme)` works
        print(f"created key {key_id} for {args.tenant}; it is shown only this once", file=sys.stderr)
    else:
        keys.revoke_key(db, args.key_id)
        print(f"revoked key {args.key_id}", file=sys.stderr)


def cmd_adapters(args: argparse.Namespace, settings: Settings) -> None:
    from billing import adapters
    from gateway.adapter_dirs import read_adapter_dir

    db = _db(settings)
    if args.action == "register":
        found = read_adapter_dir(args.path)
        adapters.register_adapter(db, args.name, found.path, found.base_model, found.rank)
        print(f"registered adapter {args.name} (rank {found.rank}) at {found.path}; a running server loads it "
              "on restart or through POST /admin/adapters/{name}/load")
    elif args.action == "grant":
        adapters.grant(db, args.name, args.tenant)
        print(f"granted {args.name} to {args.tenant}")
    else:
        rows = [(a.name, a.rank, ",".join(a.tenants) or "-", a.path) for a in adapters.list_adapters(db)]
        print(_table(("NAME", "RANK", "TENANTS", "PATH"), rows))


def cmd_report(args: argparse.Namespace, settings: Settings) -> None:
    from billing.report_formats import render
    from billing.reports import usage_report

    rows = usage_report(_db(settings), args.start, args.end, args.group_by, args.bucket)
    print(render(rows, args.format))


COMMANDS = {
    "serve": cmd_serve,
    "db": cmd_db,
    "tenants": cmd_tenants,
    "keys": cmd_keys,
    "adapters": cmd_adapters,
    "report": cmd_report,
    "budgets": lambda args, settings: budget_cli.cmd_budgets(args, settings, _db(settings), _table),
    "prices": lambda args, settings: budget_cli.cmd_prices(args, settings, _db(settings), _table),
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        debug = DEBUG.get()
        settings = _settings(args)
        COMMANDS[args.command](args, settings)
    except (CommandError, SettingsError, EnvError, BillingError, AdapterDirError) as e:
        print(f"tiergate: error: {e}", file=sys.stderr)
        return 1
    except SQLAlchemyError as e:
        print(f"tiergate: database error: {first_line(e)} (did you run `tiergate db upgrade`?)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # e.g. a model path the engine cannot load: still one line, not a traceback
        if debug:
            raise
        print(f"tiergate: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
