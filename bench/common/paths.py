"""Where the benches' files live: the checkout's root (benches run from it), bench/out/ and bench/data/."""

from __future__ import annotations

from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent.parent
ROOT = BENCH_DIR.parent
OUT = BENCH_DIR / "out"  # each bench's JSON, bench/out/<name>.json, and its plots
PASSAGES = BENCH_DIR / "data" / "passages.txt"  # real English text the prompts are cut from
