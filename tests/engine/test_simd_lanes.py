"""engine/csrc/simd_lanes.h's helpers at both vector widths, whatever this CPU is: a small program built
once for AVX-512 (16 lanes) and once for AVX2 (8 lanes), the kernels' two forms, and run where the CPU can."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from torch.utils.cpp_extension import include_paths

from engine.cpu_build import CSRC

CHECK = Path(__file__).parent / "csrc_checks" / "sum_each_check.cpp"
WIDTHS = {16: ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"], 8: ["-mavx2", "-mfma", "-mno-avx512f"]}


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.parametrize("lanes", sorted(WIDTHS))
def test_sum_each_gives_every_vectors_own_sum_in_its_lane(tmp_path, lanes):
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("no g++ here (the kernels themselves need one too)")
    if ("avx512f" if lanes == 16 else "avx2") not in cpu_flags():
        pytest.skip(f"this CPU cannot run the {lanes}-lane form")
    program = tmp_path / f"check{lanes}"
    build = subprocess.run([compiler, "-O2", *WIDTHS[lanes], *(f"-I{p}" for p in include_paths()), f"-I{CSRC}",
                            str(CHECK), "-o", str(program)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-2000:]
    run = subprocess.run([str(program)], capture_output=True, text=True)
    assert run.returncode == 0 and f"lanes {lanes}, mismatches 0" in run.stdout, run.stdout + run.stderr
