"""The Triton paged decode attention kernel, run by Triton's CPU interpreter in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.engine.paged_attention_reference import CASES, VARIANTS

HERE = Path(__file__).parent


def test_triton_paged_attention_matches_float64_reference_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, str(HERE / "triton_paged_attention_check.py")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "all cases match" in run.stdout
    assert run.stdout.count(" ok") == len(CASES) + len(VARIANTS) + 1
