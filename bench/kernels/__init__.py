"""One kernel or op alone (quantized and panel projections, paged attention, batched LoRA, grammar compiles)."""
