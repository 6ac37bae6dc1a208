"""The model's own tokenizer: encoding, the chat template, and stop tokens."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer
from transformers.utils.chat_template_utils import render_jinja_template


# Texts longer than this are encoded through encode_batch: tokenizers' encode holds the GIL for the
# whole call (seconds for a megabyte), encode_batch releases it, so a long prompt encoded on a worker
# thread leaves the event loop free. For short texts encode is the cheaper call.
RELEASE_GIL_CHARS = 8192


@dataclass
class TextTokenizer:
    tokenizer: Tokenizer
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > RELEASE_GIL_CHARS:
            return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def id_to_token_text(self, token_id: int) -> str:
        """The token's own text (as OpenAI's logprobs show it)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, variables: Mapping[str, Any] | None = None) -> str:
        """The conversation as the model's chat template writes it; ``variables`` are the template's
        own (e.g. Qwen3's ``enable_thinking``), ``continue_final_message`` leaves the last
        (assistant) message open for the model to go on with."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; use /v1/completions")
        # transformers' renderer: the same sandboxed Jinja environment HF uses.
        rendered, _ = render_jinja_template(
            conversations=[messages],
            tools=tools,
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **(variables or {}),
        )
        return rendered[0]

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None, **options: Any) -> list[int]:
        """``render_chat``'s text as token ids; ``options`` are render_chat's."""
        # The template already writes any BOS it wants; do not add another.
        return self.encode(self.render_chat(messages, tools, **options), add_special_tokens=False)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for: its longest vocabulary entry.

        An upper bound for byte-level BPE (an entry spells one byte a character, and a character
        is at least one byte) and for sentencepiece vocabularies; added tokens are counted too.
        """
        return max(map(len, self.tokenizer.get_vocab(with_added_tokens=True)), default=1)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()
