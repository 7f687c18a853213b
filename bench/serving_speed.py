"""Serving at speed: decode tokens/s of SmolLM2-135M with the policy's LoRA, side by side.

Every candidate is started once and kept up; then ``--repeats`` rounds measure each candidate
in turn (order rotated every round) at 8 and 32 concurrent requests, so slow drift of the
shared machine spreads over all of them; the table shows medians and min–max.  Each request
is a distinct short chat prompt answered with exactly ``--tokens`` tokens (``ignore_eos``,
temperature 1, logprobs and token ids on: what a rollout asks for).  tok/s = completion
tokens of the whole wave / its wall time.

Candidates (LoRA r8/α16 on all 7 projections with nonzero random B, as ``LoRATrainer`` builds
it, saved by peft):

- ``vllm base``: vLLM without ``--enable-lora`` (torch.compile on: vLLM's CPU platform turns
  compilation off whenever LoRA is enabled).
- ``vllm lora (current)``: the flags ``VLLMServer`` passes today (``--max-lora-rank 16
  --max-loras 4``), requests to the adapter; ``vllm lora server, base requests`` is the same
  server asked for the base model (the eager-mode cost without any adapter math).
- ``vllm lora (tuned)``: ``--max-lora-rank 8`` (the adapter's rank: vLLM's CPU punica ops
  gather a ``[tokens, out, max_rank]`` weight slice per token) ``--max-loras 1 --max-cpu-loras 2``.
- ``vllm merged``: peft ``merge_and_unload`` saved as a full model and served without LoRA.
- ``transformers base / lora / merged``: tracerl's transformers server (each in its own
  process so its memory can be read alone).

Peak RSS is the largest sum of RSS over the candidate's whole process tree (vLLM's API
server, engine core and workers), sampled every 0.2 s while it is measured (shared pages
are counted once per process, so it is an upper bound).  The ceiling (``bench/ceiling.py``)
is measured before and after the rounds in the same invocation; %-of-ceiling uses
0.27 GFLOP per token (2 × 135M parameters).

    flock /tmp/tracerl-heavy.lock .venv/bin/python bench/serving_speed.py [--repeats 3] [--tokens 64] [--json bench/results/serving_speed.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

GFLOP_PER_TOKEN = 0.27
CONCURRENCY = (8, 32)
PROMPTS = [f"Write a short story about robot number {i} and its favourite colour." for i in range(64)]


# --- the adapter and the merged model --------------------------------------------------
def make_adapter(model_path: Path, target: Path) -> None:
    """The trainer's LoRA (r8/α16, 7 projections) with random nonzero B: a trained-looking policy."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tracerl.train.trainer import DEFAULT_TARGET_MODULES, LoRASettings

    settings = LoRASettings()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(DEFAULT_TARGET_MODULES),
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    peft_model.save_pretrained(target)


def make_merged(model_path: Path, adapter: Path, target: Path) -> None:
    """``merge_and_unload`` of ``adapter`` into the base, saved as a full model beside the base's tokenizer."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    shutil.copytree(model_path, target, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", ".complete"))
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, adapter).merge_and_unload()
    merged.save_pretrained(target)


async def stop_servers(servers: list[Any]) -> None:
    """Stop every candidate server (a ``TransformersProcess`` stops synchronously, vLLM servers await)."""
    for server in servers:
        if isinstance(server, TransformersProcess):
            server.stop()
        else:
            await server.stop()


# --- process-tree memory ---------------------------------------------------------------
class TreeRSS:
    """Peak of the summed RSS of a process and all its descendants, sampled on a thread.

    ``peak`` sums RSS, so pages the processes share (libraries, vLLM's forked workers) count
    once per process: an upper bound.  ``pss_peak`` sums PSS (each shared page split between
    the processes that map it): the tree's own memory, what the machine must hold for it.
    """

    def __init__(self, pid: int, *, pss: bool = False) -> None:
        self.pid = pid
        self.peak = 0
        self.pss_peak = 0
        self.pss = pss
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> int:
        import psutil

        total = pss = 0
        try:
            root = psutil.Process(self.pid)
            for process in [root, *root.children(recursive=True)]:
                try:
                    if self.pss:  # reads /proc/PID/smaps_rollup: ~1 ms a process
                        info = process.memory_full_info()
                        pss += info.pss
                    else:
                        info = process.memory_info()
                    total += info.rss
                except psutil.Error:
                    pass
        except psutil.Error:
            return 0
        self.peak = max(self.peak, total)
        self.pss_peak = max(self.pss_peak, pss)
        return total

    def __enter__(self) -> "TreeRSS":
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(0.2):
                self.sample()

        self.sample()
        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()


# --- candidates ------------------------------------------------------------------------
@dataclass
class Candidate:
    label: str
    family: str  # "vllm" or "transformers": whose base it is compared with too
    base_url: str
    model: str
    pid: int
    api_key: str = ""
    peak_rss: int = 0
    startup_s: float = 0.0
    rates: dict[int, list[float]] = field(default_factory=dict)


class TransformersProcess:
    """tracerl's transformers server in a child process (``--serve-transformers``), so its memory is its own."""

    def __init__(self, model_path: Path, adapter: Path | None) -> None:
        command = [sys.executable, __file__, "--serve-transformers", str(model_path)]
        if adapter is not None:
            command += ["--adapter", str(adapter)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        line = "x"
        while line and not line.startswith("http"):
            line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the transformers server exited during start-up (code {self.process.wait()})")
        self.base_url, self.api_key = line.split()

    def stop(self) -> None:
        if self.process.stdin:
            self.process.stdin.close()
        self.process.wait(60)


def serve_transformers(model_path: str, adapter: str | None) -> None:
    """Child side: start the server, print its URL, serve until stdin closes."""
    from tracerl.inference.transformers_server import TransformersServer

    async def run() -> None:
        server = TransformersServer(model_path, served_name="bench")
        await server.start()
        if adapter:
            await server.load_adapter("bench@1", adapter)
        print(server.base_url, server.api_key, flush=True)
        await asyncio.to_thread(sys.stdin.read)
        await server.stop()

    asyncio.run(run())


async def wave(candidate: Candidate, concurrency: int, tokens: int, offset: int) -> tuple[int, float]:
    import httpx

    headers = {"Authorization": f"Bearer {candidate.api_key}"}
    async with httpx.AsyncClient(base_url=candidate.base_url, headers=headers, timeout=httpx.Timeout(3600, connect=10)) as client:

        async def one(i: int) -> int:
            body = {
                "model": candidate.model,
                "messages": [{"role": "user", "content": PROMPTS[(offset + i) % len(PROMPTS)]}],
                "max_tokens": tokens,
                "temperature": 1.0,
                "ignore_eos": True,
                "logprobs": True,
                "return_token_ids": True,
            }
            response = await client.post("/chat/completions", json=body)
            response.raise_for_status()
            return int(response.json()["usage"]["completion_tokens"])

        started = time.monotonic()
        counts = await asyncio.gather(*[one(i) for i in range(concurrency)])
        return sum(counts), time.monotonic() - started


async def measure(candidate: Candidate, tokens: int, offset: int) -> None:
    with TreeRSS(candidate.pid) as rss:
        for concurrency in CONCURRENCY:
            generated, seconds = await wave(candidate, concurrency, tokens, offset)
            if generated != concurrency * tokens:
                raise RuntimeError(f"{candidate.label}: {generated} tokens, expected {concurrency * tokens}")
            rate = generated / seconds
            candidate.rates.setdefault(concurrency, []).append(rate)
            print(f"  {candidate.label:<36} x{concurrency:<3} {rate:6.1f} tok/s  (load {os.getloadavg()[0]:.2f})", flush=True)
    candidate.peak_rss = max(candidate.peak_rss, rss.peak)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from ceiling import describe, measure_ceiling

    from tracerl.base_models import resolve_base_model
    from tracerl.inference.vllm_server import VLLMServer, vllm_python

    model_path = resolve_base_model("smollm2-135m")
    tmp = Path(tempfile.mkdtemp(prefix="tracerl-serving-speed-"))
    adapter, merged = tmp / "adapter", tmp / "merged"
    make_adapter(model_path, adapter)
    make_merged(model_path, adapter, merged)
    servers: list[Any] = []
    candidates: list[Candidate] = []
    try:
        if "vllm" in args.families and vllm_python() is not None:
            specs = [
                ("vllm base", model_path, {"enable_lora": False}, False),
                ("vllm lora (current: rank 16, 4 loras)", model_path, {}, True),
                ("vllm lora (tuned: rank 8, 1 lora, 2 cpu)", model_path, {"max_lora_rank": 8, "max_loras": 1, "max_cpu_loras": 2}, True),
                ("vllm merged (no lora)", merged, {"enable_lora": False}, False),
            ]  # fmt: skip
            for label, path, options, with_adapter in specs:
                server = VLLMServer(path, served_name="bench", **options)
                started = time.monotonic()
                await server.start()
                servers.append(server)
                startup = time.monotonic() - started
                assert server.process is not None
                if with_adapter:
                    await server.load_adapter("bench@1", str(adapter))
                key = server.api_key
                candidates.append(Candidate(label, "vllm", server.base_url, "bench@1" if with_adapter else "bench", server.process.pid, key, startup_s=startup))
                if label.startswith("vllm lora (current"):
                    candidates.append(Candidate("vllm lora server, base requests", "vllm", server.base_url, "bench", server.process.pid, key, startup_s=startup))
                print(f"  started {label} in {startup:.0f} s", flush=True)
        if "transformers" in args.families:
            for label, path, with_adapter in (
                ("transformers base", model_path, False),
                ("transformers lora", model_path, True),
                ("transformers merged", merged, False),
            ):
                started = time.monotonic()
                process = TransformersProcess(path, adapter if with_adapter else None)
                servers.append(process)
                candidates.append(Candidate(label, "transformers", process.base_url, "bench@1" if with_adapter else "bench", process.process.pid, process.api_key, startup_s=time.monotonic() - started))
        for candidate in candidates:  # warm-up on the measured shape (compilation, allocator, batch sizes)
            for concurrency in CONCURRENCY:
                await wave(candidate, concurrency, 8, 0)
        ceiling_before = measure_ceiling()
        print(describe(ceiling_before), flush=True)
        loads = []
        for round_index in range(args.repeats):
            loads.append(os.getloadavg())
            shift = round_index % len(candidates)
            for candidate in candidates[shift:] + candidates[:shift]:
                await measure(candidate, args.tokens, offset=round_index * 32)
        ceiling_after = measure_ceiling()
        print(describe(ceiling_after), flush=True)
    finally:
        await stop_servers(servers)
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "script": "bench/serving_speed.py",
        "argv": sys.argv[1:],
        "tokens_per_request": args.tokens,
        "repeats": args.repeats,
        "gflop_per_token": GFLOP_PER_TOKEN,
        "ceiling_before": ceiling_before,
        "ceiling_after": ceiling_after,
        "load_average_per_round": [list(x) for x in loads],
        "candidates": [
            {
                "label": c.label,
                "family": c.family,
                "model": c.model,
                "startup_s": c.startup_s,
                "peak_rss_mb": c.peak_rss / 2**20,
                "tok_s": {str(k): v for k, v in c.rates.items()},
            }
            for c in candidates
        ],
    }


def table(result: dict[str, Any]) -> str:
    ceiling = result["ceiling_before"]["matmul_gflops"]
    rows = result["candidates"]
    median = {(r["label"], int(k)): statistics.median(v) for r in rows for k, v in r["tok_s"].items()}
    family_base = {"vllm": "vllm base", "transformers": "transformers base"}
    lines = [
        "| candidate | concurrent | tok/s (median) | min–max | vs vLLM base | vs own base | % of matmul ceiling | peak RSS of tree (MB) |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        for k, values in r["tok_s"].items():
            c = int(k)
            rate = median[(r["label"], c)]
            vs_vllm = rate / median[("vllm base", c)] if ("vllm base", c) in median else float("nan")
            own = family_base[r["family"]]
            vs_own = rate / median[(own, c)] if (own, c) in median else float("nan")
            percent = 100 * rate * result["gflop_per_token"] / ceiling
            lines.append(
                f"| {r['label']} | {c} | {rate:.1f} | {min(values):.1f}–{max(values):.1f} | {vs_vllm:.2f}x | {vs_own:.2f}x "
                f"| {percent:.1f}% | {r['peak_rss_mb']:.0f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="rounds over all candidates")
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--families", default="vllm,transformers", help="comma-separated: vllm, transformers")
    parser.add_argument("--json", default=None, help="write the raw results here")
    parser.add_argument("--table-only", default=None, metavar="JSON", help="print the table of a stored result and exit")
    parser.add_argument("--serve-transformers", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--adapter", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_transformers:
        serve_transformers(args.serve_transformers, args.adapter)
        return
    if args.table_only:
        print(table(json.loads(Path(args.table_only).read_text())))
        return
    args.families = args.families.split(",")
    result = asyncio.run(run(args))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nSmolLM2-135M fp32, {args.tokens} tokens per request, {args.repeats} rounds\n")
    print(table(result))


if __name__ == "__main__":
    main()
