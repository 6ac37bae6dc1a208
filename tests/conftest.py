"""Shared fixtures; in CI (CI set) a skipped test fails the run (service tests are required there), except a
skip for a CPU feature the machine lacks."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


def _environ_unless_set(name: str, value: Callable[[], str]) -> Iterator[str]:
    """Sets ``name`` to ``value()`` for the session unless the caller's environment already sets it."""
    if name in os.environ:
        yield os.environ[name]
        return
    os.environ[name] = value()
    yield os.environ[name]
    del os.environ[name]


@pytest.fixture(scope="session", autouse=True)
def kernel_build_dir(tmp_path_factory: pytest.TempPathFactory):
    """The engine's JIT-built C++ kernels go to this session's tmp dir (built once per run), not the user's cache."""
    yield from _environ_unless_set("TORCH_EXTENSIONS_DIR", lambda: str(tmp_path_factory.mktemp("torch-extensions")))


@pytest.fixture(scope="session", autouse=True)
def gguf_derived_in_process():
    """GGUF metadata and weights are derived in the test's process (engine/gguf_cache.py): the suite derives
    dozens of tiny files, and a spawned child's start costs seconds each. One test pins the child path."""
    from engine.gguf_cache import DERIVE_IN_PROCESS

    yield from _environ_unless_set(DERIVE_IN_PROCESS, lambda: "1")


@pytest.fixture(scope="session")
def engine_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where GGUF conversions land; shared by the session so the bundled model converts once."""
    return tmp_path_factory.mktemp("tiergate-cache")


@pytest.fixture(autouse=True)
def root_logging_restored():
    """The root logger's handlers and level as they were before each test. A test that runs the CLI's serve in
    process gets its JSON handler on the root logger, bound to that test's captured stderr: later tests' logs
    would go to that closed stream ("--- Logging error ---" in the run's output)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _lacks_cpu_feature(report: pytest.TestReport) -> bool:
    """A skip for an instruction set this machine's CPU lacks (its reason opens with "this CPU"): CI runs on
    whatever CPU it is given, and those paths are tested where the CPU has them."""
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return reason.removeprefix("Skipped: ").startswith("this CPU")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = [r for r in reporter.stats.get("skipped", []) if not _lacks_cpu_feature(r)] if reporter else []
    if os.environ.get("CI") and skipped and exitstatus == 0:
        reporter.write_line(f"CI: {len(skipped)} test(s) skipped; service tests are required in CI", red=True)
        session.exitstatus = 1


@pytest.fixture(params=["panels", "onednn", "plain"])
def linear_path(request, monkeypatch) -> str:
    """Runs a test on every form of the projections (engine/packed_linear.py): tiergate's
    panel kernel, oneDNN with packed weights, and the plain ``torch.mm`` fallback."""
    monkeypatch.setenv("TIERGATE_PACKED_WEIGHTS", request.param)
    return request.param
