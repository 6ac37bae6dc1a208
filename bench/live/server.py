"""A `tiergate serve` subprocess for the live benches: its database set up through the CLI, started, stopped.

Every bench of bench/live/ runs the real gateway as an operator would (`tiergate db upgrade`,
`tenants create`, `keys create`, `serve`), on a free port and a throwaway database named by the
environment it is given, so that what it measures includes the HTTP edge, auth, limits and the ledger.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx

from bench.common import paths
from bench.load.plan import Tenant
from tests.support.faults import free_port

__all__ = ["GENEROUS_LIMITS", "TENANTS", "free_port", "set_up_tenants", "start_server", "stop_server", "tiergate_cli"]

TENANTS = (("acme-premium", "premium"), ("bulk-a", "standard"), ("bulk-b", "standard"))
GENEROUS_LIMITS = ["--rpm", "100000", "--tpm", "100000000", "--max-concurrent", "1000"]


def tiergate_cli(env: dict, *args: str) -> str:
    """`tiergate ARGS` against ``env``'s database; its stdout, or RuntimeError with its stderr."""
    proc = subprocess.run([sys.executable, "-m", "gateway.cli", *args], env=env, cwd=paths.ROOT,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"tiergate {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout.strip()


def set_up_tenants(env: dict, named: tuple[tuple[str, str], ...] = TENANTS,
                   limits: list[str] = GENEROUS_LIMITS) -> list[Tenant]:
    """Migrate the database and create each (name, tier) tenant with ``limits`` and a key."""
    tiergate_cli(env, "db", "upgrade")
    tenants = []
    for name, tier in named:
        tiergate_cli(env, "tenants", "create", name, "--tier", tier, *limits)
        tenants.append(Tenant(name, tier, tiergate_cli(env, "keys", "create", name).splitlines()[-1]))
    return tenants


def start_server(env: dict, policy: str, port: int, premium_slo_s: float, timeout_s: float = 600,
                 extra_args: tuple[str, ...] = ()) -> subprocess.Popen:
    """`tiergate serve` on ``port`` under ``policy``, once its /readyz answers 200 (RuntimeError if it never does)."""
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--policy", policy,
                             "--premium-ttft-slo", str(premium_slo_s), *extra_args],
                            env=env, cwd=paths.ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tiergate serve exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop_server(proc)
    raise RuntimeError(f"tiergate serve was not ready within {timeout_s:.0f} s")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGINT, the clean shutdown; killed if it has not exited within a minute."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
