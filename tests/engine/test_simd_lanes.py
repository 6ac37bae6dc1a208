"""engine/csrc/simd_lanes.h's and kv_heads.h's helpers at both vector widths, whatever this CPU is: small programs
built once for AVX-512 (16 lanes) and once for AVX2 (8 lanes), the kernels' two forms, and run where the CPU can."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from torch.utils.cpp_extension import include_paths

from engine.cpu_build import CSRC

CHECKS = Path(__file__).parent / "csrc_checks"
WIDTHS = {16: ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
          8: ["-mavx2", "-mfma", "-mf16c", "-mno-avx512f"]}


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def build_and_run(tmp_path: Path, check: str, lanes: int) -> subprocess.CompletedProcess:
    """``check`` (a program in csrc_checks) built for ``lanes`` and run; skips where it cannot."""
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("no g++ here (the kernels themselves need one too)")
    if ("avx512f" if lanes == 16 else "avx2") not in cpu_flags():
        pytest.skip(f"this CPU cannot run the {lanes}-lane form")
    program = tmp_path / f"{check}{lanes}"
    build = subprocess.run([compiler, "-O2", "-std=c++17", *WIDTHS[lanes], *(f"-I{p}" for p in include_paths()),
                            f"-I{CSRC}", str(CHECKS / f"{check}.cpp"), "-o", str(program)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-2000:]
    return subprocess.run([str(program)], capture_output=True, text=True)


@pytest.mark.parametrize("lanes", sorted(WIDTHS))
def test_sum_each_gives_every_vectors_own_sum_in_its_lane(tmp_path, lanes):
    run = build_and_run(tmp_path, "sum_each_check", lanes)
    assert run.returncode == 0 and f"lanes {lanes}, mismatches 0" in run.stdout, run.stdout + run.stderr


@pytest.mark.parametrize("lanes", sorted(WIDTHS))
def test_q8_0_heads_read_a_vector_or_a_group_at_a_time_as_value_by_value_and_max_lanes_is_the_max(tmp_path, lanes):
    run = build_and_run(tmp_path, "kv_heads_check", lanes)
    assert run.returncode == 0 and f"lanes {lanes}, mismatches 0" in run.stdout, run.stdout + run.stderr
