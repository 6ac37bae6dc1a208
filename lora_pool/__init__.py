"""Multi-LoRA serving: peft adapter loading, the slot cache (LRU + pinning), batched LoRA ops.

Imports nothing of the engine; `LoraBatch` implements engine/lora_hook.py's protocol
structurally.
"""

from lora_pool.adapter import AdapterError, AdapterSpec, BaseShapes
from lora_pool.batch import LoraBatch
from lora_pool.pool import LoraPool, TooManyAdaptersError

__all__ = ["AdapterError", "AdapterSpec", "BaseShapes", "LoraBatch", "LoraPool", "TooManyAdaptersError"]
