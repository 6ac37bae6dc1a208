"""The fixed, seeded request mix the throughput benches replay.

Prompts are windows of real English text (bench/data/passages.txt, tokenized
with the model's own tokenizer and repeated as needed); each window starts at
a different token offset, so no two prompts share a leading KV block and the
engine's prefix cache gets no unfair hits over the peers.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from bench.common import paths



@dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def build_workload(
    encode: Callable[[str], list[int]],
    num_requests: int = 64,
    prompt_len_range: tuple[int, int] = (20, 400),
    output_len_range: tuple[int, int] = (16, 256),
    seed: int = 0,
) -> list[BenchRequest]:
    """``num_requests`` requests with uniformly drawn prompt and output lengths."""
    corpus = encode(paths.PASSAGES.read_text())
    longest = prompt_len_range[1]
    if num_requests > len(corpus):
        raise ValueError(f"at most {len(corpus)} requests have distinct prompt offsets")
    stream = corpus * (longest // len(corpus) + 2)
    rng = random.Random(seed)
    offsets = rng.sample(range(len(corpus)), num_requests)
    requests = []
    for index, offset in enumerate(offsets):
        prompt_len = rng.randint(*prompt_len_range)
        output_len = rng.randint(*output_len_range)
        requests.append(BenchRequest(index, stream[offset : offset + prompt_len], output_len))
    return requests


def load_encoder(hf_dir: Path) -> Callable[[str], list[int]]:
    """The model tokenizer's encode, without special tokens (prompts are raw text)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    return lambda text: tokenizer.encode(text, add_special_tokens=False).ids
