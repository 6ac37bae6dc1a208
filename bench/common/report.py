"""A bench's report tail: its result written as JSON where asked, and its section printed.

Every bench ends the same way. The result dict goes to the path given with ``--json``; `make bench`
(bench/run_all.py) reads it back and writes the bench's section of bench/RESULTS.md with the bench's
own ``render_markdown``. The same section is printed, so a bench run by hand shows what RESULTS.md
would get, and a bench without a renderer prints its JSON (run_all then keeps the printed tail).
The JSON is written before the section is rendered: a renderer that fails loses no measurement.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import machine


def write_json(result: Any, path: str | Path, *, indent: int | None = 2,
               default: Callable[[Any], Any] | None = None) -> None:
    """``result`` as JSON at ``path``, its folder made first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=indent, default=default))


def finish(result: Any, json_path: str | Path | None, render: Callable[[Any], str] | None = None, *,
           indent: int | None = 2, default: Callable[[Any], Any] | None = None) -> None:
    """The tail of a bench's ``main``: the JSON to ``json_path`` (when given), then the section on stdout."""
    if json_path:
        write_json(result, json_path, indent=indent, default=default)
    print(render(result) if render else json.dumps(result, indent=indent, default=default))


def measured(result: dict) -> str:
    """A section's first line, the machine the result was measured on: "" for results from before it was recorded."""
    return f"Measured {machine.render_markdown(result['machine'])}." if "machine" in result else ""
