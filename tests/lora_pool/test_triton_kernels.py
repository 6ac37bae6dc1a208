"""The Triton LoRA kernels, run by Triton's CPU interpreter in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def test_triton_kernels_match_float64_reference_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, str(HERE / "triton_lora_check.py")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "all kernels match" in run.stdout
    assert run.stdout.count(" ok") == 7
