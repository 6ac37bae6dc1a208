"""`make bench`: every bench present, with settings that fit in about 30 minutes, into bench/RESULTS.md.

Each bench runs as its own subprocess (`python -m bench.KIND.NAME ...`) and writes
JSON; if its module has `render_markdown(result: dict) -> str`, that renders
its section, otherwise the tail of its printed output goes in verbatim. Plots
a bench lists under "plots" in its JSON (paths) are embedded. A bench that
fails or times out is reported as such and the rest still run.

    .venv/bin/python -m bench.run_all [--only engine_throughput,slo_sim] [--quick] [--render-only]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import machine, paths

BENCH_DIR, ROOT, OUT = paths.BENCH_DIR, paths.ROOT, paths.OUT
RESULTS = BENCH_DIR / "RESULTS.md"


@dataclass
class Bench:
    name: str  # its JSON is bench/out/<name>.json, its section in RESULTS.md is headed by the title
    module: str  # bench.<module>, e.g. "live.slo"
    title: str
    args: list[str] = field(default_factory=list)
    quick_args: list[str] | None = None  # for --quick
    json_flag: str = "--json"
    timeout_s: int = 900

    @property
    def module_name(self) -> str:
        return f"bench.{self.module}"

    @property
    def json_path(self) -> Path:
        return OUT / f"{self.name}.json"


def benches() -> list[Bench]:
    # Relative (benches run from ROOT), so RESULTS.md names no machine's checkout.
    cost_model = OUT / "step_cost.json"
    step_cost = ["--cost-model", str(cost_model.relative_to(ROOT))] if cost_model.exists() else []
    # The engine workload is cut to fit the 30-minute budget: llama.cpp and HF need about
    # 10 minutes between them for 48 requests; the Q4_1 reference run is left to a manual run.
    return [
        Bench("engine_throughput", "offline.engine_throughput",
              "Engine throughput: tiergate vs HF transformers and llama.cpp",
              ["--requests", "48", "--output-len", "16:128", "--concurrency", "1,8,32",
               "--single-stream-requests", "6", "--single-stream-rounds", "5", "--engines",
               "tiergate,llama.cpp-F32,hf-transformers,tiergate-plain,tiergate-onednn"],
              ["--requests", "16", "--concurrency", "1,8", "--single-stream-requests", "2"], timeout_s=1200),
        # The bundled file and the 360M Q4_K_M one; `python -m bench.offline.quantized --full` runs every file
        # (360M and 1B in Q8_0, Q4_0 and Q4_K_M: about an hour more, the 1B files most of it).
        Bench("quantized", "offline.quantized", "Quantized GGUF serving: tiergate vs llama.cpp on the same files",
              ["--models", "bundled,360m", "--quants", "q4_k_m", "--rounds", "3"],
              ["--models", "bundled", "--rounds", "1", "--tokens", "16", "--streams", "4", "--stream-tokens", "8",
               "--pp-reps", "1"], timeout_s=1800),
        # The bundled file only here (about 15 minutes); `--models bundled,1b` adds the ~1B file's (20 more).
        Bench("kv_cache_dtype", "offline.kv_cache_dtype",
              "The 8-bit KV cache at a 2,000-token context: tiergate float32 / Q8_0 vs llama.cpp F16 / Q8_0",
              ["--models", "bundled", "--rounds", "3"],
              ["--models", "bundled", "--prompt", "300", "--tokens", "16", "--streams", "2", "--stream-tokens", "8",
               "--rounds", "1"], timeout_s=1800),
        Bench("kv_cache_quality", "offline.kv_cache_quality",
              "What the 8-bit KV cache costs in logprobs: tiergate and llama.cpp against their float32 caches",
              quick_args=["--tokens", "100"]),
        Bench("spec_decode", "offline.spec_decode",
              "Speculative decoding (prompt lookup): on vs off, and llama.cpp's own lookup",
              ["--concurrency", "1,8,32", "--rounds", "4", "--max-tokens", "96"],
              ["--concurrency", "1,8", "--rounds", "1", "--max-tokens", "32"], timeout_s=1500),
        Bench("bf16_quality", "offline.bf16_quality",
              "The bfloat16 opt-in: logprob drift and decode speed against float32",
              quick_args=["--tokens", "32"]),
        Bench("projections", "kernels.projections",
              "A decode step's projections: the panel kernel vs oneDNN and torch.mm",
              quick_args=["--rows", "1,32", "--rounds", "2"]),
        Bench("prompt_scoring", "offline.prompt_scoring",
              "Prompt scoring (prompt logprobs, echo): tiergate vs HF transformers and llama.cpp",
              quick_args=["--prompts", "4", "--prompt-len", "32,64", "--rounds", "1"]),
        Bench("lora_throughput", "offline.lora_throughput", "Multi-LoRA throughput", quick_args=[]),
        # Reads the step-cost model engine_throughput just fitted (when it ran); SLOs scaled to it.
        Bench("slo_sim", "sim.slo",
              "SLO simulation on this CPU's cost model: tiered vs fcfs on a virtual clock", step_cost),
        Bench("slo_sim_gpu", "sim.slo",
              "SLO simulation on stated H100 coefficients: tiered vs fcfs on a virtual clock"),
        # Both the H100 coefficients and this CPU's fitted cost (when engine_throughput wrote it).
        Bench("slo_long_prompts", "sim.long_prompts",
              "Long prompts beside premium streams: the inter-token latency bound off and on",
              step_cost, ["--requests", "60", *step_cost]),
        Bench("long_prompt_gap", "offline.long_prompts",
              "A neighbour's stream beside 1,987-token prompts on the real engine: no bound, in seconds, the defaults",
              quick_args=["--rounds", "1", "--round-s", "8", "--alone-s", "3"]),
        Bench("slo_sweep", "live.slo", "SLO sweep through the real gateway: tiered vs fcfs",
              quick_args=["--rates", "0.5", "--requests", "8"], timeout_s=900),
        # Like for like with fcfs: no premium KV reserve (it would idle with no premium traffic).
        Bench("fair_share_sim", "sim.fair_share",
              "Fair share inside a tier on a virtual clock: a light tenant beside a flood",
              ["--premium-reserve", "0"]),
        # Two rounds each, interleaved, so the shared machine's load falls on both policies alike.
        Bench("fair_share_gateway", "live.fair_share",
              "Fair share through the real gateway: a light tenant beside a 30-stream flood",
              ["--policies", "tiered,tiered-step-end,fcfs", "--flood-max-tokens", "32", "--light-every", "3",
               "--alone-s", "10", "--warmup-s", "40", "--flood-s", "40", "--rounds", "2"],
              ["--flood", "4", "--alone-s", "3", "--warmup-s", "3", "--flood-s", "6"], timeout_s=1200),
        # Issue 32 without the machine's noise: the batch step share's trade, the scheduler on a virtual clock.
        Bench("batch_tier_sim", "sim.batch_tier",
              "The batch tier on a virtual clock: interactive first tokens and gaps, and output tokens/s, by batch step share",
              ["--shares", "0.2,0.5,1", "--seeds", "3"], ["--duration", "30", "--seeds", "1"]),
        # Issue 32: about 14 minutes on a quiet 2-core box (capacity, the load alone, beside the batch, the
        # batch's tail, the load alone again: three 120-second phases).
        Bench("batch_tier", "live.batch_tier",
              "The batch tier: interactive load at 70% of capacity, alone and beside a 2,000-line batch",
              quick_args=["--phase-s", "10", "--lines", "60", "--capacity-requests", "8", "--capacity-concurrency", "4",
                          "--batch-lead-s", "2", "--settle-s", "1"], timeout_s=1800),
        Bench("gateway_overhead", "live.gateway_overhead", "Gateway overhead", json_flag="--out"),
        Bench("lm_eval_batching", "live.lm_eval_batching",
              "lm-evaluation-harness local-completions: --batch_size 8 against 1",
              ["--questions", "40", "--batch-sizes", "1,8", "--rounds", "2"],
              ["--questions", "8", "--rounds", "1"]),
        Bench("structured", "offline.structured",
              "Structured outputs and n > 1: JSON-schema decoding vs free, compile time, n=4",
              ["--concurrency", "32", "--max-tokens", "32", "--rounds", "5"],
              ["--concurrency", "4", "--max-tokens", "8", "--rounds", "1"]),
        Bench("report_speed", "offline.report_speed", "Billing report speed", json_flag=""),
        Bench("chaos", "live.chaos", "Chaos: database cut, Redis restart, SIGKILL, dropped streams under load",
              quick_args=["--phase-s", "4"], timeout_s=600),
        Bench("hostile", "live.hostile",
              "Hostile tenants (issue #31): a neighbour's stream beside each attack, one at a time",
              quick_args=["--baseline-s", "8", "--window-s", "4", "--attack-timeout-s", "30",
                          "--only", "grammar_flood,tools_900kb,prompt_logprobs_n16,refusals_400"], timeout_s=1800),
    ]


def run_bench(bench: Bench, quick: bool) -> dict:
    args = bench.quick_args if quick and bench.quick_args is not None else bench.args
    cmd = [sys.executable, "-m", bench.module_name, *args]
    if bench.json_flag:
        bench.json_path.unlink(missing_ok=True)
        cmd += [bench.json_flag, str(bench.json_path.relative_to(ROOT))]
    shown = " ".join(shlex.quote(c) for c in [".venv/bin/python", *cmd[1:]])
    print(f"run_all: {shown}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=None, text=True, timeout=bench.timeout_s)
        status, stdout = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as exc:
        status, stdout = "timeout", exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
    sys.stderr.write(stdout)
    result = None
    if bench.json_flag and bench.json_path.exists():
        result = json.loads(bench.json_path.read_text())
    return {"command": shown, "status": status, "wall_s": time.perf_counter() - started,
            "stdout": stdout, "result": result}


def reuse_bench(bench: Bench) -> dict | None:
    """The bench's last JSON, for rewriting RESULTS.md without running anything."""
    if not bench.json_flag or not bench.json_path.exists():
        return None
    args = [".venv/bin/python", "-m", bench.module_name, *bench.args, bench.json_flag,
            str(bench.json_path.relative_to(ROOT))]
    return {"command": " ".join(shlex.quote(a) for a in args), "status": 0, "wall_s": None, "stdout": "",
            "result": json.loads(bench.json_path.read_text())}


def render_section(bench: Bench, run: dict) -> str:
    wall = "not timed (rendered from its last JSON)" if run["wall_s"] is None else f"{run['wall_s']:.0f} s"
    status = "exit 0" if run["status"] == 0 else f"**status {run['status']}**"
    lines = [f"## {bench.title}", "", f"Command: `{run['command']}`  ", f"Wall time: {wall}; {status}", ""]
    module = importlib.import_module(bench.module_name)
    renderer = getattr(module, "render_markdown", None)
    if renderer and run["result"] is not None:
        lines.append(renderer(run["result"]))
    else:
        tail = "\n".join(run["stdout"].rstrip().splitlines()[-60:])
        lines += ["```", tail or "(no output)", "```"]
    for plot in (run["result"] or {}).get("plots", []) if isinstance(run["result"], dict) else []:
        lines.append(f"![{Path(plot).stem}]({os.path.relpath(ROOT / plot, BENCH_DIR)})")
    return "\n".join(lines) + "\n"


def split_sections(text: str) -> tuple[str, list[str]]:
    """A results file's head (before its first `## ` heading) and its `## ` sections, each with its heading."""
    parts = re.split(r"(?m)^(?=## )", text)
    head, sections = (parts[0], parts[1:]) if parts and not parts[0].startswith("## ") else ("", parts)
    return head, sections


def merge_results(old: str, header: str, new_sections: list[str]) -> str:
    """RESULTS.md after a run: this run's header, each bench's section put where its earlier one stood (or
    appended), and every other section (those written by hand) kept as it was, so a partial run (`--only`) or a
    full one never drops a measurement that `make bench` does not make."""
    _, old_sections = split_sections(old)
    fresh = {section.splitlines()[0]: section for section in new_sections}
    merged = [fresh.pop(section.splitlines()[0], section) for section in old_sections]
    merged += [section for section in new_sections if section.splitlines()[0] in fresh]
    return header + "\n" + "".join(section if section.endswith("\n") else section + "\n" for section in merged)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.run_all", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help="comma-separated bench names")
    p.add_argument("--quick", action="store_true", help="small settings, to check the wiring")
    p.add_argument("--render-only", action="store_true", help="rewrite RESULTS.md from bench/out/*.json")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    OUT.mkdir(exist_ok=True)
    only = {n for n in args.only.split(",") if n}
    host = machine.describe()
    started = time.perf_counter()
    sections = []
    failed = []
    for bench in benches():
        if only and bench.name not in only:
            continue
        if importlib.util.find_spec(bench.module_name) is None:
            print(f"run_all: {bench.module_name} is not in this checkout; skipped", file=sys.stderr)
            continue
        if bench.name in ("slo_sim", "slo_long_prompts"):  # engine_throughput may have just written the cost model
            bench.args = next(b for b in benches() if b.name == bench.name).args
        run = reuse_bench(bench) if args.render_only else run_bench(bench, args.quick)
        if run is None:
            continue
        if run["status"] != 0:
            failed.append(bench.name)
        sections.append(render_section(bench, run))
    header = [
        "# Benchmark results",
        "",
        "Written by `make bench` (`python -m bench.run_all`), which replaces the sections of the benches it ran and keeps "
        "every other section (those headed \"by hand\" were run on their own, each with its command, date and machine).",
        "",
        f"Machine: {machine.render_markdown(host)}.  ",
        f"Total wall time: {time.perf_counter() - started:.0f} s.",
        "",
    ]
    RESULTS.write_text(merge_results(RESULTS.read_text() if RESULTS.exists() else "", "\n".join(header), sections))
    print(f"run_all: wrote {RESULTS}" + (f"; failed: {', '.join(failed)}" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
