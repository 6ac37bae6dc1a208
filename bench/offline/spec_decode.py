"""Speculative decoding (prompt lookup) on the bundled model: on against off, and llama.cpp's own lookup.

Two workloads on the same prompts for every engine: ``copying`` (the prompt holds a piece of code
or text and asks for it back with a few changes, greedy: the answer repeats most of the prompt)
and ``open`` (open-ended prompts sampled at temperature 1, so the output does not fall into a
loop a lookup would predict). At each concurrency, tiergate with speculation off and on run the
same requests (at least ``--requests`` a round) one after the other, round after round, which goes
first alternating, so that both see the same load on a shared machine; the figure is the ratio of
their output tokens per second, over all rounds and as the median of each round's (the goals read
the median). llama.cpp runs the same
prompts at concurrency 1 through llama-cpp-python on the same bundled Q4_1 file (`make bench` builds its
wheel without ggml's AMX buffer, whose Q4_1 kernel crashes on AMX CPUs), plain and with
``LlamaPromptLookupDecoding`` (its prompt lookup), interleaved the same way.

    .venv/bin/python -m bench.offline.spec_decode [--concurrency 1,8,32] [--rounds 4] [--requests 16] [--max-tokens 128] [--json OUT]
        [--speculative draft --draft-model DIR]   (tiergate's drafts from a draft model instead of prompt lookup)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import machine
from bench.common.report import finish
from engine.config import EngineConfig
from engine.engine import Engine
from engine.events import StepEvent
from engine.request import EngineRequest, SamplingParams

SNIPPETS = [
    ("python", "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
               "    return total / len(values)\n\n\ndef variance(values):\n    m = mean(values)\n"
               "    total = 0\n    for value in values:\n        total += (value - m) ** 2\n"
               "    return total / len(values)\n", "mean", "average"),
    ("python", "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
               "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n"
               "    def is_empty(self):\n        return len(self.items) == 0\n", "items", "elements"),
    ("javascript", "function greet(name) {\n  const message = 'Hello, ' + name + '!';\n  console.log(message);\n"
                   "  return message;\n}\n\nfunction farewell(name) {\n  const message = 'Goodbye, ' + name + '!';\n"
                   "  console.log(message);\n  return message;\n}\n", "message", "text"),
    ("text", "The museum opens at nine in the morning and closes at six in the evening. Tickets cost twelve "
             "dollars for adults and six dollars for children. Guided tours start every hour from the main hall. "
             "Photography is allowed in all galleries except the special exhibition on the second floor.",
     "museum", "gallery"),
]
OPEN_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a strange message.",
    "Describe your ideal weekend in a few sentences.",
    "What are some creative uses for an old bicycle?",
    "Tell me about a dream city of the future.",
    "Write a poem about autumn rain.",
    "Explain why people enjoy travelling to new places.",
    "Invent a new holiday and describe how people celebrate it.",
    "Write a letter from a cat to its owner.",
]


def copying_messages() -> list[list[dict]]:
    return [[{"role": "user", "content": f"Rewrite this {kind} exactly as it is, but replace every '{old}' with "
                                         f"'{new}'. Answer with the rewritten {kind} only.\n\n{body}"}]
            for kind, body, old, new in SNIPPETS]


def open_messages() -> list[list[dict]]:
    return [[{"role": "user", "content": p}] for p in OPEN_PROMPTS]


@dataclass
class Run:
    seconds: float = 0.0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0

    def add(self, other: Run) -> None:
        self.seconds += other.seconds
        self.tokens += other.tokens
        self.drafted += other.drafted
        self.accepted += other.accepted

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def run_tiergate(engine: Engine, events: list, prompts: list[list[int]], params: SamplingParams, concurrency: int,
                 speculative: bool, tag: str, requests: int = 0) -> Run:
    """``prompts`` repeated to make ``requests`` requests (at least one each, and ``concurrency`` streams),
    ``concurrency`` at a time."""
    count = max(len(prompts), concurrency, requests)
    requests = [EngineRequest(f"{tag}-{i}", prompts[i % len(prompts)],
                              SamplingParams(**{**vars(params), "seed": i if params.seed is None else params.seed + i}),
                              speculative=speculative) for i in range(count)]
    events.clear()
    started = time.perf_counter()
    tokens = 0
    for i in range(0, count, concurrency):
        tokens += sum(len(ids) for _, ids in engine.generate_batch_sync(requests[i:i + concurrency]))
    seconds = time.perf_counter() - started
    steps = [e for e in events if isinstance(e, StepEvent)]
    return Run(seconds, tokens, sum(s.draft_tokens for s in steps), sum(s.accepted_tokens for s in steps))


def run_llama_cpp(llm, prompts: list[list[int]], params: SamplingParams) -> Run:
    started = time.perf_counter()
    tokens = 0
    for i, prompt in enumerate(prompts):
        llm.reset()
        out = llm.create_completion(prompt, max_tokens=params.max_tokens, temperature=params.temperature,
                                    top_p=1.0, top_k=0, min_p=0.0, repeat_penalty=1.0, seed=i)
        tokens += out["usage"]["completion_tokens"]
    return Run(time.perf_counter() - started, tokens)


def llama_cpp_models(num_pred_tokens: int):
    """(plain, lookup) llama-cpp-python models on the bundled GGUF, or None without llama-cpp-python."""
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        return None
    from bench.common.model_files import bundled_gguf

    threads = os.cpu_count() or 1
    common = dict(model_path=str(bundled_gguf()), n_ctx=2048, n_threads=threads, n_threads_batch=threads,
                  verbose=False, logits_all=False)
    return (Llama(**common),
            Llama(**common, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=num_pred_tokens)))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=4)
    # A round of a few seconds is at the mercy of a shared machine's moment; of 16 requests it is not.
    ap.add_argument("--requests", type=int, default=16, help="requests per round and mode, at least")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--speculative", choices=["ngram", "draft"], default="ngram")
    ap.add_argument("--draft-model", help="with --speculative draft: the draft model (HF directory or .gguf)")
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]

    config = EngineConfig(model="bundled", speculative=args.speculative, draft_model=args.draft_model,
                          num_speculative_tokens=args.num_speculative_tokens,
                          max_num_seqs=max(levels), max_model_len=1024)
    engine = Engine(config).start()
    events: list = []
    engine.add_listener(events.append)
    workloads = {
        "copying": ([engine.tokenizer.apply_chat_template(m) for m in copying_messages()],
                    SamplingParams(max_tokens=args.max_tokens, temperature=0.0)),
        "open": ([engine.tokenizer.apply_chat_template(m) for m in open_messages()],
                 SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=0)),
    }
    command = "python -m bench.offline.spec_decode " + " ".join(argv if argv is not None else sys.argv[1:])
    result: dict = {"machine": machine.describe(), "command": command.strip(),
                    "loadavg_before": Path("/proc/loadavg").read_text().split()[:3], "tiergate": {}, "llama_cpp": {}}
    try:
        for name, (prompts, params) in workloads.items():
            run_tiergate(engine, events, prompts, params, 1, True, "warm")  # warm-up: kernels, thread tuner
            for level in levels:
                off, on, pairs = Run(), Run(), []
                for r in range(args.rounds):
                    # Off then on, then on then off: a machine that drifts within a pair favours neither.
                    pair = {}
                    for speculative in ((False, True) if r % 2 == 0 else (True, False)):
                        pair[speculative] = run_tiergate(engine, events, prompts, params, level, speculative,
                                                         f"{name}-{level}-{'on' if speculative else 'off'}-{r}",
                                                         args.requests)
                    off.add(pair[False])
                    on.add(pair[True])
                    pairs.append(pair[True].tokens_per_s / pair[False].tokens_per_s)
                result["tiergate"][f"{name}@{level}"] = _entry(off, on, pairs)
                print(name, level, result["tiergate"][f"{name}@{level}"], flush=True)
    finally:
        engine.shutdown()
    models = None if args.no_llama_cpp else llama_cpp_models(args.num_speculative_tokens)
    if models is not None:
        plain, lookup = models
        for name, (prompts, params) in workloads.items():
            run_llama_cpp(lookup, prompts[:1], params)
            off, on, pairs = Run(), Run(), []
            for _ in range(args.rounds):
                plain_run, lookup_run = run_llama_cpp(plain, prompts, params), run_llama_cpp(lookup, prompts, params)
                off.add(plain_run)
                on.add(lookup_run)
                pairs.append(lookup_run.tokens_per_s / plain_run.tokens_per_s)
            result["llama_cpp"][f"{name}@1"] = _entry(off, on, pairs)
            print("llama.cpp", name, result["llama_cpp"][f"{name}@1"], flush=True)
    result["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    finish(result, args.json, render_markdown)
    return result


def _entry(off: Run, on: Run, pairs: list[float]) -> dict:
    """``speedup``: over all rounds; ``pair_median``: the median of each round's on/off, which a machine whose
    speed drifts between rounds moves less."""
    return {"off_tok_s": round(off.tokens_per_s, 2), "on_tok_s": round(on.tokens_per_s, 2),
            "speedup": round(on.tokens_per_s / off.tokens_per_s, 3) if off.tokens_per_s else None,
            "pair_median": round(statistics.median(pairs), 3), "pairs": [round(p, 3) for p in pairs],
            "acceptance": round(on.accepted / on.drafted, 3) if on.drafted else None,
            "drafted": on.drafted, "accepted": on.accepted, "tokens_off": off.tokens, "tokens_on": on.tokens}


def render_markdown(result: dict) -> str:
    lines = ["| workload @ concurrency | off tok/s | on tok/s | on/off, all rounds | on/off, median of rounds (each) "
             "| acceptance |", "|---|---|---|---|---|---|"]
    for key, e in result["tiergate"].items():
        lines.append(f"| tiergate {key} | {e['off_tok_s']} | {e['on_tok_s']} | {e['speedup']}x | {_pairs(e)} "
                     f"| {e['acceptance']} |")
    for key, e in result["llama_cpp"].items():
        lines.append(f"| llama.cpp {key} (plain / LlamaPromptLookupDecoding) | {e['off_tok_s']} | {e['on_tok_s']} | "
                     f"{e['speedup']}x | {_pairs(e)} | |")
    for key in result["llama_cpp"]:
        if key in result["tiergate"]:
            ours = result["tiergate"][key]["on_tok_s"]
            theirs = result["llama_cpp"][key]["on_tok_s"]
            lines.append(f"\ntiergate lookup / llama.cpp lookup, {key}: {ours / theirs:.2f}x" if theirs else "")
    lines.append("")
    lines += [f"- [{'MET' if met else 'MISSED'}] {goal}" for goal, met in goals(result)]
    lines.append(f"\nload average before {result['loadavg_before']}, after {result['loadavg_after']}")
    return "\n".join(lines)


def _pairs(entry: dict) -> str:
    if "pair_median" not in entry:  # a result from before rounds were paired
        return "-"
    return f"{entry['pair_median']}x ({', '.join(str(p) for p in entry['pairs'])})"


def goals(result: dict) -> list[tuple[str, bool]]:
    """Issue 33's goals that this run measured, each judged on the median of its rounds' on/off."""
    ours, theirs = result["tiergate"], result["llama_cpp"]
    judged: list[tuple[str, bool]] = []
    if "copying@1" in ours:
        judged.append(("copying, one stream: on >= 2.0x off", ours["copying@1"]["pair_median"] >= 2.0))
        if theirs.get("copying@1", {}).get("on_tok_s"):
            judged.append(("copying, one stream: on >= 1.0x llama.cpp's lookup",
                           ours["copying@1"]["on_tok_s"] >= theirs["copying@1"]["on_tok_s"]))
    if "copying@8" in ours:
        judged.append(("copying, 8 streams: on >= 1.3x off", ours["copying@8"]["pair_median"] >= 1.3))
    for key in (k for k in ours if k.startswith("open@")):
        judged.append((f"open, {key[5:]} streams: on >= 0.95x off", ours[key]["pair_median"] >= 0.95))
    return judged


if __name__ == "__main__":
    main()
