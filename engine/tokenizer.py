"""The model's own tokenizer: encoding, the chat template, and stop tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import Tokenizer
from transformers.utils.chat_template_utils import render_jinja_template


@dataclass
class TextTokenizer:
    tokenizer: Tokenizer
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def id_to_token_text(self, token_id: int) -> str:
        """The token's own text (as OpenAI's logprobs show it)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; use /v1/completions")
        # transformers' renderer: the same sandboxed Jinja environment HF uses.
        rendered, _ = render_jinja_template(
            conversations=[messages],
            tools=tools,
            chat_template=self.chat_template,
            add_generation_prompt=True,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )
        return rendered[0]

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        # The template already writes any BOS it wants; do not add another.
        return self.encode(self.render_chat(messages, tools), add_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()
