"""Building the C++ kernels: a build killed halfway never stops a later start.

torch marks a JIT build under way with a plain ``lock`` file that its builder deletes when done; a
builder killed mid-build leaves it, and torch's next load of that extension waits for it forever.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import cpu_build

ROOT = Path(__file__).resolve().parents[2]


def test_a_lock_left_by_a_dead_builder_is_cleared_and_the_build_is_ours_alone_while_held(tmp_path):
    (tmp_path / "lock").touch()
    with cpu_build.sole_builder(tmp_path):
        assert not (tmp_path / "lock").exists()
        with open(tmp_path / "tiergate.flock") as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another process would wait here
    with open(tmp_path / "tiergate.flock") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released on the way out


def test_a_start_after_a_build_killed_halfway_loads_the_kernels_rather_than_waiting_forever():
    if not cpu_build.quant_kernels_loaded():
        pytest.skip("the C++ kernels do not build here (no compiler)")
    folder = cpu_build.build_folder(cpu_build.QUANT_BUILD, cpu_build.quant_sources())
    (folder / "lock").touch()  # what a builder killed mid-build leaves
    try:
        started = subprocess.run([sys.executable, "-c", "from engine.cpu_build import quant_kernels_loaded as q; "
                                  "print(q())"], cwd=ROOT, env=os.environ, capture_output=True, text=True, timeout=300)
    finally:
        (folder / "lock").unlink(missing_ok=True)
    assert started.stdout.strip() == "True", started.stderr[-2000:]
