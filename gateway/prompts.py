"""A request's prompt as token ids: what cannot fit is refused before it is tokenized, the rest is tokenized
off the event loop.

A prompt of more than ``max_model_len * max_token_chars`` characters (the model's
context times its tokenizer's longest vocabulary entry) cannot fit in the context,
so it is refused as ``context_length_exceeded`` without tokenizing it: tokenizing a
megabyte takes seconds of CPU. A chat prompt's characters are everything the template
will render: the messages' text, the calls and call ids in their history, and the
tools' names, descriptions and schemas. What may fit is tokenized inline when short,
else on a small pool of threads (``tokenizer_threads``), so long prompts queue for the
pool instead of for the event loop (engine/tokenizer.py releases the GIL for them).
"""

from __future__ import annotations

import asyncio
import functools
import json
from concurrent.futures import ThreadPoolExecutor

from engine.tokenizer import TextTokenizer
from gateway.errors import APIError, invalid_param
from gateway.schemas import GenerationRequest
from gateway.tools import chat_messages, template_takes_tools

# Shorter prompts are tokenized inline: a thread hop costs more than their encode.
INLINE_TOKENIZE_CHARS = 8192


class PromptEncoder:
    def __init__(self, engine, threads: int) -> None:
        # Anything with the engine's ``tokenizer`` and ``max_model_len``, read at the first prompt:
        # apps built on stand-in engines that never see one (probes, benches) need neither.
        self._engine = engine
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenize")

    @property
    def tokenizer(self) -> TextTokenizer:
        return self._engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @functools.cached_property
    def max_chars(self) -> int:
        return self.max_model_len * self.tokenizer.max_token_chars

    def check_size(self, req: GenerationRequest) -> int:
        """The prompt's size in characters before rendering; 400 when it cannot fit the context. Cheap: no
        template, no tokenizer, so it runs before any other cost of the request."""
        if req.kind == "completion":
            size = len(req.prompt)  # a tuple of token ids is checked id by id in token_ids()
            if isinstance(req.prompt, tuple) or size <= self.max_chars:
                return size
            param = "prompt"
        else:
            history, tools = chat_chars(req)
            size = history + tools
            if size <= self.max_chars:
                return size
            param = "tools" if tools > history else "messages"
        raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens, and no "
                       f"prompt of more than {self.max_chars} characters fits in it; yours has {size} (its "
                       f"'{param}' the most). Please reduce the length of the prompt.", param=param,
                       code="context_length_exceeded")

    async def token_ids(self, req: GenerationRequest) -> list[int]:
        """The prompt's token ids; 400 for an empty prompt or one that cannot fit the context."""
        param = "messages" if req.kind == "chat" else "prompt"
        if req.kind == "completion" and isinstance(req.prompt, tuple):
            ids = self._checked_ids(req.prompt)
        else:
            size = self.check_size(req)
            if size <= INLINE_TOKENIZE_CHARS:
                ids = self._encode(req)
            else:
                ids = await asyncio.get_running_loop().run_in_executor(self._pool, self._encode, req)
        if not ids:
            raise invalid_param(param, "The prompt is empty.", "invalid_value")
        return ids

    async def encode_texts(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Texts tokenized as completion prompts are: inline when short together, else in one hop to the pool.

        The caller bounds their size (a list prompt's or /tokenize's checks)."""
        def encode() -> list[list[int]]:
            return [self.tokenizer.encode(t, add_special_tokens) for t in texts]
        if sum(map(len, texts)) <= INLINE_TOKENIZE_CHARS:
            return encode()
        return await asyncio.get_running_loop().run_in_executor(self._pool, encode)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _checked_ids(self, ids: tuple[int, ...]) -> list[int]:
        vocab = self.tokenizer.vocab_size
        if any(t >= vocab for t in ids):
            raise invalid_param("prompt", f"Prompt token ids must be smaller than the vocabulary size {vocab}.",
                                "invalid_value")
        return list(ids)

    def _encode(self, req: GenerationRequest) -> list[int]:
        if req.kind == "completion":
            return self.tokenizer.encode(req.prompt)
        takes_tools = template_takes_tools(self.tokenizer.chat_template)
        tools = [t.openai() for t in req.tools.tools] if req.tools is not None and takes_tools else None
        try:
            template = req.template
            return self.tokenizer.apply_chat_template(
                chat_messages(req.messages, req.tools, takes_tools), tools,
                add_generation_prompt=template.add_generation_prompt,
                continue_final_message=template.continue_final_message, variables=template.variables)
        except Exception as e:  # a template may reject a conversation (e.g. roles out of order)
            raise invalid_param("messages", f"The messages could not be formatted for this model: {e}",
                                "invalid_value") from None


def chat_chars(req: GenerationRequest) -> tuple[int, int]:
    """Characters a chat prompt renders, without rendering it: (the messages with their calls, the tools)."""
    history = 0
    for m in req.messages:
        history += len(m.content) + len(m.tool_call_id or "")
        for call in m.tool_calls:
            history += len(call["id"]) + len(call["function"]["name"]) + len(call["function"]["arguments"])
    tools = 0
    if req.tools is not None:
        for tool in req.tools.tools:
            # The schema as the template or the fallback prompt writes it: JSON text.
            tools += len(tool.name) + len(tool.description or "") + len(json.dumps(tool.parameters))
    return history, tools
