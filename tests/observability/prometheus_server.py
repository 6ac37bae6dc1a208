"""A real Prometheus server (Debian's binary) on loopback, for end-to-end tests of scraping and rules."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

INSTALL_HINT = "install Debian's prometheus package: apt-get install -y --no-install-recommends prometheus"


def require_binary(name: str) -> str:
    """The path of a Prometheus binary; a missing one fails the test (it must never be skipped)."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found on PATH; {INSTALL_HINT}", pytrace=False)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PrometheusServer:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def query(self, promql: str) -> list[dict]:
        response = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=10)
        response.raise_for_status()
        body = response.json()
        assert body["status"] == "success", body
        return body["data"]["result"]

    def wait_for(self, promql: str, timeout_s: float = 60.0, predicate=bool) -> list[dict]:
        """Poll ``promql`` until ``predicate(result)`` holds; fail with the server's log otherwise."""
        deadline = time.monotonic() + timeout_s
        result: list[dict] = []
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"prometheus exited:\n{self.log_path.read_text()[-3000:]}")
            try:
                result = self.query(promql)
            except httpx.TransportError:
                result = []
            except httpx.HTTPStatusError as e:
                if e.response.status_code != 503:  # 503: still starting (its storage is not ready yet)
                    raise
                result = []
            if predicate(result):
                return result
            time.sleep(0.25)
        pytest.fail(f"{promql} never satisfied the check within {timeout_s}s; last result {result}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_prometheus(workdir: Path, target: str, rule_files: list[Path]) -> PrometheusServer:
    """Start Prometheus scraping ``target`` (host:port) every second, evaluating ``rule_files`` every second."""
    binary = require_binary("prometheus")
    config = workdir / "prometheus.yml"
    rules = "\n".join(f"  - {path}" for path in rule_files)
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"rule_files:\n{rules}\n"
        "scrape_configs:\n  - job_name: tiergate\n"
        f"    static_configs:\n      - targets: ['{target}']\n"
    )
    port = free_port()
    log_path = workdir / "prometheus.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=1h",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    server = PrometheusServer(f"http://127.0.0.1:{port}", process, log_path)
    try:
        server.wait_for("up", predicate=lambda r: bool(r))
    except BaseException:
        server.stop()
        raise
    return server
