"""Demo adapters trained on the bundled SmolLM2-135M-Instruct (lora_pool/demo_adapters/train.py): `french` answers
in French, `uppercase` answers in upper case. `make serve` registers and grants them."""

from __future__ import annotations

from pathlib import Path

DEMO_ADAPTERS_DIR = Path(__file__).resolve().parent


def demo_adapters(root: Path = DEMO_ADAPTERS_DIR) -> dict[str, Path]:
    """Name -> directory of each adapter under `root` (by default the committed demo adapters)."""
    if not root.is_dir():
        return {}
    return {p.name: p for p in sorted(root.iterdir()) if (p / "adapter_config.json").is_file()}
