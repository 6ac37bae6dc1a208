"""No product module or kernel source grows past 400 lines: one module, one job, each readable at one sitting (#36).

Applied migrations are history, not code to read: they stay as written and are not counted.
"""

from __future__ import annotations

from pathlib import Path

from tests.common.test_import_graph import PRODUCT

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 400


def test_no_product_module_is_longer_than_400_lines():
    modules = [path for package in PRODUCT for path in sorted((ROOT / package).rglob("*.py"))]
    assert len(modules) > 100, "the product's packages were not found"
    too_long = {str(path.relative_to(ROOT)): n for path in modules
                if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not too_long, f"modules past {MAX_LINES} lines: {too_long}"


def test_no_kernel_source_is_longer_than_400_lines():
    sources = sorted(path for pattern in ("*.cpp", "*.h") for path in (ROOT / "engine" / "csrc").glob(pattern))
    assert len(sources) > 10, "the kernels' sources were not found"
    too_long = {path.name: n for path in sources if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not too_long, f"kernel sources past {MAX_LINES} lines: {too_long}"
