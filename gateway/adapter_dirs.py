"""What the gateway reads of a peft adapter directory before handing it to billing and the engine.

Only the identity (rank, base model) that billing records; the full check of
the weights is lora_pool's, when the engine loads the adapter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class AdapterDirError(ValueError):
    pass


@dataclass(frozen=True)
class AdapterDir:
    path: str  # absolute, so a server started elsewhere finds it
    rank: int
    base_model: str


def read_adapter_dir(path: str) -> AdapterDir:
    try:
        root = Path(path).expanduser()
        is_dir = root.is_dir()
    except (OSError, ValueError) as e:  # a name too long for the OS, or one it cannot encode
        raise AdapterDirError(f"adapter path {path[:200]!r} cannot be used: {e.__class__.__name__}") from None
    if not is_dir:
        raise AdapterDirError(f"adapter path {path!r} is not a directory")
    config_file = root / "adapter_config.json"
    if not config_file.is_file():
        raise AdapterDirError(f"{path!r} has no adapter_config.json (expected a peft LoRA directory)")
    if not (root / "adapter_model.safetensors").is_file():
        raise AdapterDirError(f"{path!r} has no adapter_model.safetensors")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterDirError(f"{config_file} is not valid JSON: {e}") from None
    rank = config.get("r") if isinstance(config, dict) else None
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise AdapterDirError(f"{config_file} has no positive integer rank 'r'")
    return AdapterDir(str(root.resolve()), rank, str(config.get("base_model_name_or_path") or ""))
