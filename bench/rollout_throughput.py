"""Rollout throughput on the demo's real shape: vLLM (LoRA and merged) vs tracerl's transformers server.

The workload is ``examples/demo.py``'s: its system prompt, ``add`` tool and two worked examples
(the real ~400-token first-turn prompt, built by the demo's own ``first_turn_messages``), one
group of ``--rollouts`` (16) rollouts of one task at T=1 (seeded per rollout) sent together,
each multi-turn like the demo's ``rollout``: turn 1 (``max_tokens`` 40) -> the ``add`` call
and its tool result appended -> turn 2, the answer (``max_tokens`` 12), through the OpenAI
SDK with ``tools``, ``logprobs`` and ``return_token_ids``, as the demo asks.

Two things are fixed so that the candidates do the same work, whatever the policy writes:
every turn generates exactly its ``max_tokens`` (``ignore_eos``), and turn 2 always follows
the path of a correct call (the assistant message is the task's ``add`` call, as the server
parses it from a trained policy's reply, then the tool's result) — the path the trained demo
policy takes on every rollout.  The policy is the demo's LoRA (r16/alpha32 on the seven
projections, random nonzero B: a trained-looking adapter).

Candidates, all up at once and measured in turn (order rotated every round, ``--repeats``
rounds, one warm-up group on the same shape each before the first round):

- ``vllm merged`` — the demo's default (``--serving merged``): vLLM without LoRA (torch.compile
  on), the merged policy loaded with ``VLLMServer.reload_weights``, as ``LocalBackend`` does
  after each step.
- ``vllm lora`` — ``--serving lora``: vLLM with ``VLLMServer``'s LoRA flags, the adapter
  loaded by name.
- ``transformers lora`` — the demo without vLLM: tracerl's transformers server (own process)
  with the adapter.

Before every group, each candidate gets a new policy version the way the demo's step gives it
one (untimed): vLLM merged reloads the weights (its prefix cache is dropped), the LoRA
servers load the adapter under a new name (``bench@N``).  So every group starts with a cold
cache for its policy and the group's 16 rollouts share their prompt among themselves only.

Per group: wall time from sending the 16 rollouts to the last answer; tokens/s = sampled
tokens (both turns) / wall; % of ceiling = 2 x P x tokens/s over the best fp32 matmul rate of
``bench/ceiling.py`` measured in this invocation just before the rounds (decode FLOPs only:
prompt prefill is left out, P = 134.5M).  Peak RSS: the largest summed RSS of the candidate's
whole process tree (vLLM's API server, engine core, workers), sampled every 0.2 s.

    flock /tmp/tracerl-heavy.lock .venv/bin/python bench/rollout_throughput.py [--repeats 3] [--json bench/results/rollout_throughput.json]
    .venv/bin/python bench/rollout_throughput.py --table-only bench/results/rollout_throughput.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

PARAMETERS = 134.5e6
TURN_TOKENS = (40, 12)  # examples/demo.py: turn(40) for the call, turn(12) for the answer
LORA = {"r": 16, "alpha": 32}  # examples/demo.py's lora_config


def make_policy(model_path: Path, adapter: Path, merged: Path) -> None:
    """The demo's LoRA with random nonzero B, saved by peft, and the same policy merged (``write_merged_model``)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tracerl.train.merged_weights import write_merged_model
    from tracerl.train.trainer import DEFAULT_TARGET_MODULES

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    config = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=0.0, target_modules=list(DEFAULT_TARGET_MODULES), task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    peft_model.save_pretrained(adapter)
    write_merged_model(peft_model, model_path, merged)


@dataclass
class Candidate:
    label: str
    base_url: str
    api_key: str
    pid: int
    refresh: Any  # async (version) -> model name to ask for
    startup_s: float = 0.0
    peak_rss: int = 0
    groups: list[dict[str, Any]] = field(default_factory=list)
    refresh_s: list[float] = field(default_factory=list)


async def rollout(client: Any, demo: Any, model: str, task: dict[str, int], seed: int) -> list[Any]:
    """The demo's two turns, the second after the task's correct ``add`` call; the usage of each."""
    messages = demo.first_turn_messages(task)
    usages = []

    async def turn(max_tokens: int) -> Any:
        completion = await client.chat.completions.create(
            model=model,
            messages=messages,
            tools=[demo.ADD_TOOL],
            max_tokens=max_tokens,
            temperature=1.0,
            logprobs=True,
            seed=seed,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        usages.append(completion.usage)
        return completion

    await turn(TURN_TOKENS[0])
    call = {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": json.dumps({"a": task["a"], "b": task["b"]})}}
    messages = [*messages, {"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "call_0", "content": str(task["a"] + task["b"])}]
    await turn(TURN_TOKENS[1])
    return usages


async def group(candidate: Candidate, demo: Any, model: str, task: dict[str, int], rollouts: int, seed: int) -> dict[str, Any]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=candidate.base_url, api_key=candidate.api_key, timeout=3600, max_retries=0)
    try:
        started = time.monotonic()
        usages = await asyncio.gather(*[rollout(client, demo, model, task, seed * 1000 + i) for i in range(rollouts)])
        seconds = time.monotonic() - started
    finally:
        await client.close()
    sampled = [[u.completion_tokens for u in turns] for turns in usages]
    if any(s != list(TURN_TOKENS) for s in sampled):
        raise RuntimeError(f"{candidate.label}: sampled {sampled}, expected {list(TURN_TOKENS)} per rollout")
    prompts = [[u.prompt_tokens for u in turns] for turns in usages]
    return {
        "seconds": seconds,
        "sampled_tokens": sum(map(sum, sampled)),
        "prompt_tokens": sum(map(sum, prompts)),
        "prompt_tokens_per_turn": prompts[0],
        "load_average": list(os.getloadavg()),
    }


async def start_candidates(args: argparse.Namespace, model_path: Path, adapter: Path, merged: Path) -> tuple[list[Candidate], list[Any]]:
    from serving_speed import TransformersProcess

    from tracerl.inference.vllm_server import VLLMServer, vllm_python

    candidates: list[Candidate] = []
    servers: list[Any] = []
    wanted = args.candidates.split(",")
    have_vllm = vllm_python() is not None
    if not have_vllm and any(c.startswith("vllm") for c in wanted):
        print("  vllm: skipped (runtime not installed: python -m tracerl.inference.vllm_server install)", flush=True)
    if "vllm-merged" in wanted and have_vllm:
        server = VLLMServer(model_path, served_name="bench", enable_lora=False)
        started = time.monotonic()
        await server.start()
        servers.append(server)
        assert server.process is not None

        async def reload(version: int, server: Any = server) -> str:
            await server.reload_weights(merged)  # the demo's hot-load: same weights, prefix cache dropped
            return "bench"

        candidates.append(Candidate("vllm merged (demo default)", server.base_url, server.api_key, server.process.pid, reload, time.monotonic() - started))
    if "vllm-lora" in wanted and have_vllm:
        server = VLLMServer(model_path, served_name="bench")
        started = time.monotonic()
        await server.start()
        servers.append(server)
        assert server.process is not None

        async def load(version: int, server: Any = server) -> str:
            await server.load_adapter(f"bench@{version}", str(adapter))
            if version > 1:
                await server.unload_adapter(f"bench@{version - 1}")
            return f"bench@{version}"

        candidates.append(Candidate("vllm lora (--serving lora)", server.base_url, server.api_key, server.process.pid, load, time.monotonic() - started))
    if "transformers-lora" in wanted:
        started = time.monotonic()
        process = TransformersProcess(model_path, None)
        servers.append(process)

        async def load_http(version: int, process: Any = process) -> str:
            import httpx

            headers = {"Authorization": f"Bearer {process.api_key}"}
            async with httpx.AsyncClient(timeout=600, headers=headers) as client:
                body = {"lora_name": f"bench@{version}", "lora_path": str(adapter)}
                (await client.post(process.base_url + "/load_lora_adapter", json=body)).raise_for_status()
                if version > 1:
                    (await client.post(process.base_url + "/unload_lora_adapter", json={"lora_name": f"bench@{version - 1}"})).raise_for_status()
            return f"bench@{version}"

        candidates.append(Candidate("transformers lora (demo without vLLM)", process.base_url, process.api_key, process.process.pid, load_http, time.monotonic() - started))
    for c in candidates:
        print(f"  started {c.label} in {c.startup_s:.0f} s", flush=True)
    return candidates, servers


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from ceiling import describe, measure_ceiling
    from demo_step import load_demo
    from serving_speed import TreeRSS, stop_servers

    from tracerl.base_models import resolve_base_model

    demo = load_demo()
    model_path = resolve_base_model("smollm2-135m")
    tmp = Path(tempfile.mkdtemp(prefix="tracerl-rollout-throughput-"))
    adapter, merged = tmp / "adapter", tmp / "merged"
    make_policy(model_path, adapter, merged)
    tasks = demo.make_tasks(args.seed, args.repeats + 1)
    candidates, servers = await start_candidates(args, model_path, adapter, merged)
    try:
        version = 1
        for c in candidates:  # warm-up: one whole group on the measured shape
            model = await c.refresh(version)
            await group(c, demo, model, tasks[0], args.rollouts, seed=0)
        ceiling = measure_ceiling()
        print(describe(ceiling), flush=True)
        for round_index in range(args.repeats):
            version += 1
            shift = round_index % len(candidates)
            for c in candidates[shift:] + candidates[:shift]:
                started = time.monotonic()
                model = await c.refresh(version)
                c.refresh_s.append(time.monotonic() - started)
                with TreeRSS(c.pid) as rss:
                    g = await group(c, demo, model, tasks[round_index + 1], args.rollouts, seed=round_index + 1)
                c.peak_rss = max(c.peak_rss, rss.peak)
                c.groups.append(g)
                print(
                    f"  round {round_index + 1} {c.label:<38} {g['seconds']:6.1f} s  {g['sampled_tokens'] / g['seconds']:6.1f} tok/s"
                    f"  (load {g['load_average'][0]:.2f})",
                    flush=True,
                )
        ceiling_after = measure_ceiling()
        print(describe(ceiling_after), flush=True)
    finally:
        await stop_servers(servers)
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "script": "bench/rollout_throughput.py",
        "argv": sys.argv[1:],
        "rollouts_per_group": args.rollouts,
        "turn_tokens": list(TURN_TOKENS),
        "lora": LORA,
        "repeats": args.repeats,
        "parameters": PARAMETERS,
        "ceiling_before": ceiling,
        "ceiling_after": ceiling_after,
        "candidates": [
            {
                "label": c.label,
                "startup_s": c.startup_s,
                "refresh_s": c.refresh_s,
                "peak_rss_mb": c.peak_rss / 2**20,
                "groups": c.groups,
            }
            for c in candidates
        ],
    }


def table(result: dict[str, Any]) -> str:
    ceiling = result["ceiling_before"]["matmul_gflops"]
    rows = result["candidates"]
    reference = next((r for r in rows if r["label"].startswith("vllm merged")), rows[0])

    def rate(r: dict[str, Any]) -> list[float]:
        return [g["sampled_tokens"] / g["seconds"] for g in r["groups"]]

    ref = statistics.median(rate(reference))
    first = rows[0]["groups"][0]
    lines = [
        f"one group = {result['rollouts_per_group']} rollouts × 2 turns ({' + '.join(map(str, result['turn_tokens']))} sampled tokens), "
        f"prompt {first['prompt_tokens_per_turn'][0]} tokens (turn 1) / {first['prompt_tokens_per_turn'][1]} (turn 2); "
        f"{result['repeats']} groups per candidate; ceiling {ceiling:.1f} GFLOP/s before the rounds, "
        f"{result['ceiling_after']['matmul_gflops']:.1f} after",
        "",
        "| candidate | s per group (median) | min–max | sampled tok/s (median) | min–max | rollouts/s | % of matmul ceiling (2·P·tok/s) "
        f"| vs {reference['label'].split(' (')[0]} | policy refresh (s) | start-up (s) | peak RSS of process tree (MB) |",
        "|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        seconds = [g["seconds"] for g in r["groups"]]
        rates = rate(r)
        med_s, med_r = statistics.median(seconds), statistics.median(rates)
        percent = 100 * 2 * result["parameters"] * med_r / 1e9 / ceiling
        lines.append(
            f"| {r['label']} | {med_s:.1f} | {min(seconds):.1f}–{max(seconds):.1f} | {med_r:.1f} | {min(rates):.1f}–{max(rates):.1f} "
            f"| {result['rollouts_per_group'] / med_s:.2f} | {percent:.1f}% | {med_r / ref:.2f}x | {statistics.median(r['refresh_s']):.2f} "
            f"| {r['startup_s']:.0f} | {r['peak_rss_mb']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="measured groups per candidate (rounds)")
    parser.add_argument("--rollouts", type=int, default=16, help="rollouts per group (sent together)")
    parser.add_argument("--seed", type=int, default=0, help="task numbers (demo.make_tasks)")
    parser.add_argument("--candidates", default="vllm-merged,vllm-lora,transformers-lora")
    parser.add_argument("--json", default=None, help="write the raw results here")
    parser.add_argument("--table-only", default=None, metavar="JSON", help="print the table of a stored result and exit")
    args = parser.parse_args()
    if args.table_only:
        print(table(json.loads(Path(args.table_only).read_text())))
        return
    result = asyncio.run(run(args))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print()
    print(table(result))


if __name__ == "__main__":
    main()
