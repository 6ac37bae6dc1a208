"""lm-evaluation-harness's `local-completions` against `tiergate serve`: one loglikelihood task from a
local JSONL at several `--batch_size`s, the same loglikelihoods from each, and the wall time of each.

lm-eval sends a batch as one completions request with a list of token-id prompts (``echo``,
``logprobs: 1``, ``max_tokens: 1``) and tokenizes through the server's /tokenize (its remote tokenizer,
found through /tokenizer_info), so the run needs no hub and no local copy of the tokenizer: the task is
a multiple-choice arithmetic quiz written to a temporary JSONL and read by `datasets`' json builder.
Batch sizes run in alternating order each round; the report gives each one's median wall time and
the largest difference of any choice's loglikelihood from batch size 1's.

    .venv/bin/python -m bench.live.lm_eval_batching [--questions 40] [--batch-sizes 1,8] [--rounds 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import machine, report
from bench.live.server import free_port, set_up_tenants, start_server, stop_server

TASK = "tiergate_local_arithmetic"
# Nothing may reach a hub: `datasets` reads the local JSONL with its packaged json builder.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def write_task(folder: Path, questions: int, seed: int = 0) -> Path:
    """A multiple-choice quiz of ``questions`` sums as a JSONL file and the lm-eval task YAML that reads it."""
    rng = random.Random(seed)
    rows = []
    for _ in range(questions):
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        wrong = rng.sample([a + b + d for d in (-3, -2, -1, 1, 2, 3, 10)], 3)
        choices = [a + b, *wrong]
        rng.shuffle(choices)
        rows.append({"question": f"Question: What is {a} plus {b}?\nAnswer:", "choices": [f" {c}" for c in choices],
                     "answer": choices.index(a + b)})
    data = folder / "questions.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{question}}\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n")
    return folder


def evaluate(base_url: str, model: str, key: str, task_dir: Path, batch_size: int) -> dict:
    """One lm-eval run: its wall time, accuracy, and each question's choices' loglikelihoods."""
    os.environ.update(OFFLINE)
    os.environ["OPENAI_API_KEY"] = key  # local-completions' own header
    import lm_eval
    from lm_eval.tasks import TaskManager

    args = dict(base_url=f"{base_url}/v1/completions", model=model, tokenizer_backend="remote", auth_token=key,
                num_concurrent=1, max_retries=1, tokenized_requests=True, timeout=600)
    started = time.perf_counter()
    out = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=[TASK], batch_size=batch_size,
                                  task_manager=TaskManager(include_path=str(task_dir)), log_samples=True)
    wall = time.perf_counter() - started
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    return {"wall_s": wall, "acc": out["results"][TASK]["acc,none"],
            "loglikelihoods": [[float(r[0][0]) for r in s["resps"]] for s in samples]}


def largest_difference(a: list[list[float]], b: list[list[float]]) -> float:
    """The largest difference of one choice's loglikelihood between two runs of the same questions."""
    assert [len(q) for q in a] == [len(q) for q in b], "the runs scored different choices"
    return max(abs(x - y) for qa, qb in zip(a, b) for x, y in zip(qa, qb))


def run(args: argparse.Namespace) -> dict:
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    runs: dict[int, list[dict]] = {b: [] for b in sizes}
    described = machine.describe()  # its load average is the one at the start
    with tempfile.TemporaryDirectory(prefix="tiergate-lm-eval-") as tmp:
        task_dir = write_task(Path(tmp), args.questions)
        env = {**os.environ, "TIERGATE_DATABASE_URL": f"sqlite:///{tmp}/tiergate.db",
               "TIERGATE_SPOOL_PATH": f"{tmp}/spool.jsonl", "TIERGATE_LOG_LEVEL": "warning"}
        key = set_up_tenants(env)[0].key
        port = free_port()
        server = start_server(env, "tiered", port, premium_slo_s=600)
        try:
            base_url = f"http://127.0.0.1:{port}"
            model = httpx.get(f"{base_url}/v1/models", headers={"authorization": f"Bearer {key}"}).json()["data"][0]["id"]
            for round_ in range(args.rounds):
                for b in sizes if round_ % 2 == 0 else sizes[::-1]:
                    print(f"lm_eval_batching: round {round_ + 1}, batch size {b}", file=sys.stderr, flush=True)
                    runs[b].append(evaluate(base_url, model, key, task_dir, b))
        finally:
            stop_server(server)
    reference = runs[sizes[0]][0]["loglikelihoods"]
    by_size = {}
    for b, rs in runs.items():
        by_size[str(b)] = {
            "wall_s": statistics.median(r["wall_s"] for r in rs), "rounds_wall_s": [r["wall_s"] for r in rs],
            "acc": rs[0]["acc"], "max_abs_diff": max(largest_difference(reference, r["loglikelihoods"]) for r in rs),
        }
    return {"machine": described, "model": model, "questions": args.questions, "choices": 4,
            "rounds": args.rounds, "reference_batch_size": sizes[0], "batch_sizes": by_size}


def render_markdown(result: dict) -> str:
    ref = result["reference_batch_size"]
    lines = [machine.render_markdown(result["machine"]), "",
             f"lm-eval 0.4.13 `local-completions` (remote tokenizer) against `tiergate serve` ({result['model']}), "
             f"{result['questions']} questions x {result['choices']} choices, median of {result['rounds']} rounds "
             "(batch sizes alternating order).", "",
             f"| --batch_size | wall s | each round | vs batch size {ref} | acc | max diff of a loglikelihood |",
             "|---:|---:|---|---:|---:|---:|"]
    base = result["batch_sizes"][str(ref)]["wall_s"]
    for b, r in result["batch_sizes"].items():
        each = ", ".join(f"{w:.1f}" for w in r["rounds_wall_s"])
        lines.append(f"| {b} | {r['wall_s']:.1f} | {each} | {base / r['wall_s']:.2f}x | {r['acc']:.3f} "
                     f"| {r['max_abs_diff']:.1e} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=40)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    result = run(args)
    report.finish(result, args.json, render_markdown, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
