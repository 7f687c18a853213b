"""A prepared GPU check: tracerl's real GRPO step and transformers-server decode on random Llama models.

Runs where only PyTorch, transformers and peft are installed (no vLLM, no network, no weights):
each model is a randomly initialised ``LlamaForCausalLM`` with a published shape, saved to a
temporary folder with a synthetic word-level tokenizer (its vocabulary is exactly the model's),
then loaded the way tracerl loads any base model.  Random weights time the same matmuls as
trained ones; nothing here measures quality.

Per shape it measures

* **GRPO step** — ``pack_sequences`` + ``LoRATrainer.step`` (tracerl's trainer, bf16 on CUDA,
  fp32 on CPU): ``--groups`` groups of ``--group-size`` completions sharing one prompt each.
  Tokens/s is reported twice: *computed* (tokens the packed forward really runs: a group's
  prompt once, then each completion) and *logical* (prompt + completion of every sequence,
  what an unpacked trainer would run).  Peak memory: ``torch.cuda.max_memory_allocated`` on
  CUDA, the process's peak RSS (``ru_maxrss``, model load included) on CPU.  Beside it, the
  memory plan's trainer peak for the same settings (``tracerl plan``; on CUDA their ratio, the
  plan predicting allocator bytes) and ``tracerl export``'s streamed merge of the trained
  adapter into the base's shards (seconds, the process's peak RSS before and after).
* **decode** — ``TransformersServer`` over HTTP at 1, 8 and 32 concurrent chat requests of
  ``--decode-tokens`` tokens each (``ignore_eos``): completion tokens/s across all requests.
* **agreement** — the whole path at the plan's settings: ``LocalBackend`` (transformers server, bf16
  on CUDA) registers the model (memory plan, checkpointing as the plan chooses), ``--agreement-groups``
  groups are sampled through the OpenAI client inside ``tracerl.rollout``, and one GRPO step trains
  them.  The step's mismatch (KL and largest |Δ logprob| between the trainer's and the server's
  logprob of every sampled token) is the bf16 train–inference agreement at that size; memory after
  ``register`` and over the step beside the plan's (on CUDA their ratio).

Shapes: Llama-3.1-8B's first, then SmolLM2-135M's and Llama-3.2-1B's.  Each shape runs in its own
subprocess (so one shape's memory peak or crash never touches the other's numbers) within
``--budget-s`` (8 min) in all.  ``--tiny`` shrinks both shapes and the work so
the check runs on a CPU in seconds (the test suite runs ``--device cpu --tiny``).

    python bench/gpu_check.py                       # on a GPU machine (not yet run on one; 8 min at most)
    python bench/gpu_check.py --device cpu --tiny   # the smoke version (seconds)

``--families all`` measures the six families of :mod:`tracerl.families` instead: each family's
real architecture class and structural settings, its real tokenizer and chat template, at
``--sizes`` (``0.5b`` by default; ``1.5b`` and ``8b`` are Qwen2.5-1.5B's and Llama-3.1-8B's widths
and depths), bf16 on a GPU.  The decode prompts go through the family's own chat template.

    python bench/gpu_check.py --families all                        # six families at ~0.5B (GPU)
    python bench/gpu_check.py --families qwen3 --sizes 0.5b,1.5b,8b # one family at three sizes
    python bench/gpu_check.py --device cpu --tiny --families all    # the smoke version (the suite)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may touch the network
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SMOLLM2_135M = {  # HuggingFaceTB/SmolLM2-135M-Instruct's config.json (134.5M parameters)
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192, "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
}
LLAMA_1B = {  # meta-llama/Llama-3.2-1B's shape (1.24B parameters); context capped at 8192 here
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
}
LLAMA_8B = {  # meta-llama/Llama-3.1-8B's shape (8.03B parameters); context capped at 8192 here
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}
SHAPES = {"llama-8b-shape": LLAMA_8B, "smollm2-135m-shape": SMOLLM2_135M, "llama-1b-shape": LLAMA_1B}
"""The default run, in this order: the 8B shape first, so it is measured whatever the budget leaves for the others."""
TINY_SHAPES = {  # the same two families, small enough for seconds on a shared CPU
    "tiny-smollm2-shape": {**SMOLLM2_135M, "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2,
                           "num_attention_heads": 3, "num_key_value_heads": 1, "vocab_size": 2048},
    "tiny-llama-shape": {**LLAMA_1B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4096},
}
CONCURRENCY = (1, 8, 32)
SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


# --- the random model folder -------------------------------------------------------
def write_random_model(shape: dict[str, Any], folder: Path, device: str, seed: int = 0) -> int:
    """Save a randomly initialised Llama of ``shape`` and a matching tokenizer to ``folder``; return its parameter count."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from tracerl.inference.devices import dtype_for

    shape = dict(shape)
    rope_theta = shape.pop("rope_theta")
    config = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config.rope_parameters = {"rope_type": "default", "rope_theta": rope_theta}  # transformers 5.x
    config.rope_theta = rope_theta  # transformers 4.x reads this one
    torch.manual_seed(seed)
    dtype, default = dtype_for(device), torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialised in its dtype: an 8B model in fp32 would hold 32 GB before a cast
    try:
        with torch.device(device):  # and where it will run: an 8B model inits in seconds on a GPU
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(folder)
    parameters = sum(p.numel() for p in model.parameters())
    del model
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), shape["vocab_size"])})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<unk>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS[1:]})
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return parameters


def random_words(count: int, vocab: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(len(SPECIALS), vocab) for _ in range(count)]


# --- measurements --------------------------------------------------------------------
def _torch_dtype(args: argparse.Namespace) -> Any:
    """``--dtype`` as torch's (None: bf16 on CUDA, fp32 on CPU, as tracerl chooses)."""
    import torch

    return None if args.dtype == "auto" else getattr(torch, args.dtype)


def _peak_memory_mb(device: str) -> dict[str, float | None]:
    import torch

    gpu = torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else None
    return {"peak_gpu_mb": gpu, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _reset_peak(device: str) -> None:
    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def measure_train(folder: Path, shape: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Median wall time of ``LoRATrainer.step`` on packed GRPO groups, after warm-up."""
    import torch

    from tracerl.train.grpo import equal_trajectory_weights
    from tracerl.train.packing import pack_sequences
    from tracerl.train.tokenization import TrainingSequence
    from tracerl.train.trainer import LoRASettings, LoRATrainer, StepConfig

    _reset_peak(args.device)
    trainer = LoRATrainer(folder, lora=LoRASettings(r=8, alpha=16), device=args.device, dtype=_torch_dtype(args))
    P, C = args.prompt_tokens, args.completion_tokens
    sequences = []
    for g in range(args.groups):
        prompt = random_words(P, shape["vocab_size"], seed=1000 + g)
        for i in range(args.group_size):
            sequences.append(TrainingSequence(
                token_ids=prompt + random_words(C, shape["vocab_size"], seed=g * 100 + i),
                weights=[0.0] * P + [1.0] * C,
                old_logprobs=[float("nan")] * (P + C),
                trajectory_index=len(sequences),
                group_index=g,
                advantage=1.0 if i % 2 == 0 else -1.0,
            ))
    weights = equal_trajectory_weights([s.num_trainable for s in sequences])
    config = StepConfig(learning_rate=1e-5)
    times, metrics, batches = [], {}, []
    for i in range(args.warmup + args.steps):
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        batches = pack_sequences(sequences, weights, max_tokens=args.micro_batch_tokens, pad_token_id=0)
        metrics = trainer.step(batches, config)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - started)
    median = statistics.median(times)
    computed = int(metrics["forward_tokens"])
    logical = len(sequences) * (P + C)
    result = {
        "dtype": str(trainer.dtype).removeprefix("torch."),
        "step_s": times,
        "step_s_median": median,
        "sequences": len(sequences),
        "computed_tokens": computed,
        "logical_tokens": logical,
        "trained_tokens": int(metrics["trained_tokens"]),
        "computed_tokens_per_s": computed / median,
        "logical_tokens_per_s": logical / median,
        "micro_batches": len(batches),
        "loss": metrics["loss"],
        "grad_norm": metrics["grad_norm"],
        **_peak_memory_mb(args.device),
        "plan_trainer_peak_mb": _planned_peak_mb(folder, trainer, args),
    }
    if args.device.startswith("cuda"):  # the plan predicts allocator bytes, which a GPU reports exactly
        result["plan_vs_measured"] = result["plan_trainer_peak_mb"] / result["peak_gpu_mb"] - 1
    result["merge"] = measure_merge(folder, trainer)
    del trainer, batches
    _reset_peak(args.device)
    return result


def _planned_peak_mb(folder: Path, trainer: Any, args: argparse.Namespace) -> float:
    """The memory plan's trainer peak for this step's settings (``tracerl plan``; nothing loaded)."""
    from tracerl.train.memory_plan import PlanSettings, plan

    dtype = "bfloat16" if str(trainer.dtype).endswith("bfloat16") else "float32"
    row = max(args.micro_batch_tokens, args.prompt_tokens + args.completion_tokens)
    settings = PlanSettings(device="cuda" if args.device.startswith("cuda") else "cpu", gpu_memory_bytes=1 << 50, lora_rank=8,
                            seq_len=row, micro_batch_tokens=args.micro_batch_tokens, dtype=dtype, inference=None)  # fmt: skip
    return plan(folder, settings, suggest=False).trainer_peak / 2**20


def measure_merge(folder: Path, trainer: Any) -> dict[str, Any]:
    """``tracerl export``'s streamed merge of the trained adapter into the base's shards: seconds and the process's RSS."""
    from tracerl.train.export import write_hf_folder

    with tempfile.TemporaryDirectory(prefix="tracerl-gpu-check-merge-") as tmp:
        checkpoint, target = Path(tmp) / "checkpoint", Path(tmp) / "merged"
        trainer.save(checkpoint, step=1, with_optimizer=False)
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        started = time.perf_counter()
        write_hf_folder(checkpoint, folder, target)
        seconds = time.perf_counter() - started
        written = sum(f.stat().st_size for f in target.glob("*.safetensors")) / 2**20
    return {"merge_s": seconds, "merged_mb": written, "peak_rss_mb_before": rss_before,
            "peak_rss_mb_after": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


async def _decode_round(base_url: str, concurrency: int, prompt: str, max_tokens: int, api_key: str) -> dict[str, Any]:
    import httpx

    body = {"model": "base", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 1.0, "ignore_eos": True}
    latencies: list[float] = []
    tokens = 0

    async def one(client: httpx.AsyncClient) -> None:
        nonlocal tokens
        started = time.perf_counter()
        response = await client.post(f"{base_url}/chat/completions", json=body)
        response.raise_for_status()
        latencies.append(time.perf_counter() - started)
        tokens += int(response.json()["usage"]["completion_tokens"])

    async with httpx.AsyncClient(timeout=600, headers={"Authorization": f"Bearer {api_key}"}) as client:
        started = time.perf_counter()
        await asyncio.gather(*(one(client) for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return {"concurrency": concurrency, "completion_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "latency_s_median": statistics.median(latencies)}


def measure_decode(folder: Path, shape: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """``TransformersServer`` decode throughput at each concurrency (one warm-up request first)."""
    from tracerl.inference.transformers_server import TransformersServer

    _reset_peak(args.device)
    server = TransformersServer(folder, max_batch_rows=max(CONCURRENCY), device=args.device, dtype=_torch_dtype(args))

    async def run() -> dict[str, Any]:
        await server.start()
        try:
            prompt = " ".join(f"w{t}" for t in random_words(args.decode_prompt_tokens, shape["vocab_size"], seed=7))
            await _decode_round(server.base_url, 1, prompt, 2, server.api_key)  # warm-up: first kernels, allocator
            rounds = [await _decode_round(server.base_url, c, prompt, args.decode_tokens, server.api_key) for c in CONCURRENCY]
            return {"dtype": str(server.engine.dtype).removeprefix("torch."), "rounds": rounds,
                    "max_batch_rows": server.engine.stats["max_rows"], **_peak_memory_mb(args.device)}
        finally:
            await server.stop()

    result = asyncio.run(run())
    del server
    _reset_peak(args.device)
    return result


def measure_agreement(folder: Path, shape: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """tracerl's whole path at the plan's settings: ``LocalBackend`` with the transformers server (bf16 on a GPU)
    registers the model (the memory plan, gradient checkpointing as the plan chooses, the trainer, the server),
    groups are sampled through the OpenAI client inside ``tracerl.rollout``, and one GRPO step trains them.  The
    step's ``mismatch_*`` metrics compare the trainer's logprob of every sampled token with the server's (the
    train–inference mismatch); memory is measured after ``register`` and over the step, beside the plan's."""
    import torch

    import tracerl
    from tracerl.train.memory_plan import PlanSettings, plan

    cuda = args.device.startswith("cuda")
    dtype = str(_torch_dtype(args) or (torch.bfloat16 if cuda else torch.float32)).removeprefix("torch.")

    def allocated_mb() -> float:
        return torch.cuda.memory_allocated() / 2**20 if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def peak_mb() -> float:
        return torch.cuda.max_memory_allocated() / 2**20 if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    settings = PlanSettings(device="cuda" if cuda else "cpu", gpu_memory_bytes=1 << 50, lora_rank=8, seq_len=4096,
                            micro_batch_tokens=args.micro_batch_tokens, dtype=dtype, inference="transformers")  # fmt: skip
    planned = plan(folder, settings, suggest=False)
    prompt = " ".join(f"w{t}" for t in random_words(args.decode_prompt_tokens, shape["vocab_size"], seed=11))
    _reset_peak(args.device)

    async def run(runs: Path) -> dict[str, Any]:
        backend = tracerl.LocalBackend(runs, inference="transformers", device=args.device, dtype=dtype,
                                       micro_batch_tokens=args.micro_batch_tokens)  # fmt: skip
        model = tracerl.TrainableModel("gpu-check", "gpu-check", str(folder), lora_config={"r": 8, "alpha": 16})
        try:
            started = time.perf_counter()
            await model.register(backend)
            registered = {"s": time.perf_counter() - started, "measured_mb": allocated_mb(),
                          "plan_mb": (planned.trainer_resident + planned.vllm_awake) / 2**20}  # fmt: skip
            client = model.openai_client()

            async def sample(index: int) -> tracerl.Trajectory:
                async with tracerl.rollout(model) as captured:
                    await client.chat.completions.create(
                        model=model.get_inference_name(), messages=[{"role": "user", "content": prompt}],
                        max_tokens=args.agreement_tokens, temperature=1.0, seed=index,
                    )  # fmt: skip
                captured.trajectory.reward = float(index % 2)  # a spread of rewards: every advantage is non-zero
                return captured.trajectory

            started = time.perf_counter()
            groups = [tracerl.TrajectoryGroup(await asyncio.gather(*(sample(g * args.group_size + i) for i in range(args.group_size))))
                      for g in range(args.agreement_groups)]  # fmt: skip
            sampled_s = time.perf_counter() - started
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
            result = await backend.train(model, groups, learning_rate=1e-5)
            metrics = result.metrics
            step = {"s": time.perf_counter() - started, "measured_peak_mb": peak_mb(), "plan_mb": planned.peak / 2**20}
            out = {"dtype": dtype, "registered": registered, "sample_s": sampled_s, "step": step,
                   **{k: metrics[k] for k in ("mismatch_kl", "mismatch_abs_mean", "mismatch_abs_max", "mismatch_tokens", "trained_tokens")}}  # fmt: skip
            if cuda:  # allocator bytes against the plan's, as plan-check does on this CPU with the process's peak
                out["plan_vs_measured"] = {"registered": registered["plan_mb"] / registered["measured_mb"] - 1,
                                           "step": step["plan_mb"] / step["measured_peak_mb"] - 1}  # fmt: skip
            return out
        finally:
            await backend.close()

    with tempfile.TemporaryDirectory(prefix="tracerl-gpu-check-run-") as runs:
        result = asyncio.run(run(Path(runs)))
    _reset_peak(args.device)
    return result


def write_family_model(name: str, folder: Path, device: str) -> tuple[int, dict[str, Any]]:
    """Save a random model of family ``name`` (``family:size``) with its real tokenizer and template."""
    from transformers import AutoConfig, AutoTokenizer

    from tracerl.families.models import write_random_model as write_family

    family, size = name.split(":")
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    write_family(family, folder, shape=size, dtype=dtype, device=device)
    config = AutoConfig.from_pretrained(folder)
    parameters = _saved_parameters(folder)
    # token ids drawn below stay inside the tokenizer (the embedding rows are padded past it)
    shape = {"vocab_size": len(AutoTokenizer.from_pretrained(folder)), "architecture": config.architectures[0],
             **{k: getattr(config, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers")}}
    return parameters, shape


def _saved_parameters(folder: Path) -> int:
    """Parameters in the saved weights, read from the safetensors headers (nothing is loaded)."""
    import math

    from safetensors import safe_open

    total = 0
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            total += sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
    return total


def run_shape(name: str, shape: dict[str, Any] | None, args: argparse.Namespace) -> dict[str, Any]:
    """Build the random model ``name`` (a Llama ``shape``, or ``family:size`` when ``shape`` is None) and measure it."""
    with tempfile.TemporaryDirectory(prefix=f"tracerl-gpu-check-{name.replace(':', '-')}-") as tmp:
        folder = Path(tmp)
        started = time.perf_counter()
        if shape is None:
            parameters, shape = write_family_model(name, folder, args.device)
        else:
            parameters = write_random_model(shape, folder, args.device)
        out: dict[str, Any] = {"shape": name, "config": shape, "parameters": parameters,
                               "build_s": time.perf_counter() - started}
        out["train"] = measure_train(folder, shape, args)
        out["decode"] = measure_decode(folder, shape, args)
        out["agreement"] = measure_agreement(folder, shape, args) if args.agreement_groups else None
    return out


# --- orchestration -------------------------------------------------------------------
def environment(device: str) -> dict[str, Any]:
    import peft
    import torch
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "peft": peft.__version__, "device": device, "gpu_name": None, "gpu_free_mb": None, "gpu_total_mb": None}
    if device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info()
        env.update(gpu_name=torch.cuda.get_device_name(), gpu_free_mb=free / 2**20, gpu_total_mb=total / 2**20)
    return env


def targets(args: argparse.Namespace) -> dict[str, dict[str, Any] | None]:
    """The models to measure: Llama ``--shapes``, and ``family:size`` for each of ``--families`` × ``--sizes``
    (None: the family's own architecture and tokenizer, :mod:`tracerl.families.models`)."""
    from tracerl.families.models import ARCHITECTURES
    from tracerl.families.models import SHAPES as FAMILY_SIZES

    shapes = TINY_SHAPES if args.tiny else SHAPES
    chosen: dict[str, dict[str, Any] | None] = {}
    if args.shapes or not args.families:
        names = args.shapes.split(",") if args.shapes else list(shapes)
        unknown = [n for n in names if n not in shapes]
        if unknown:
            raise SystemExit(f"unknown shape(s) {unknown}; choose from {list(shapes)}")
        chosen.update({n: shapes[n] for n in names})
    if args.families:
        families = list(ARCHITECTURES) if args.families == "all" else args.families.split(",")
        sizes = ["tiny"] if args.tiny else args.sizes.split(",")
        unknown = [f for f in families if f not in ARCHITECTURES] + [s for s in sizes if s not in FAMILY_SIZES]
        if unknown:
            raise SystemExit(f"unknown famil(ies)/size(s) {unknown}; families: {list(ARCHITECTURES)}, sizes: {list(FAMILY_SIZES)}")
        chosen.update({f"{family}:{size}": None for family in families for size in sizes})
    return chosen


def worker(args: argparse.Namespace) -> None:
    result = run_shape(args.worker, targets(args)[args.worker], args)
    result["vllm_imported"] = "vllm" in sys.modules
    print("RESULT " + json.dumps(result), flush=True)


def _run_isolated(name: str, argv: list[str], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--worker", name]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout, 1.0))
    except subprocess.TimeoutExpired:
        return {"shape": name, "error": f"timed out after {timeout:.0f} s (--budget-s)"}
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        return {"shape": name, "error": f"worker exited {proc.returncode}: {proc.stderr[-3000:]}"}
    return json.loads(line.removeprefix("RESULT "))


def print_table(report: dict[str, Any]) -> None:
    env = report["environment"]
    print(f"\ndevice {env['device']} ({env['gpu_name'] or platform.processor() or 'cpu'}), torch {env['torch']}, "
          f"transformers {env['transformers']}, peft {env['peft']}; wall {report['wall_s']:.0f} s\n")
    print("| shape | params | dtype | GRPO s/step | computed tok/s | logical tok/s | peak train mem (MB) | plan (MB) | merge s | "
          + " | ".join(f"decode tok/s @{c}" for c in CONCURRENCY) + " | peak decode mem (MB) | mismatch KL | max abs Δlogprob | "
          "LocalBackend step mem (MB) | plan (MB) |")
    print("|---|---|---|---|---|---|---|---|---|" + "---|" * len(CONCURRENCY) + "---|---|---|---|---|")
    for shape in report["shapes"]:
        if "error" in shape:
            print(f"| {shape['shape']} | failed: {shape['error'][:200]} |")
            continue
        t, d, a = shape["train"], shape["decode"], shape["agreement"]
        memory = lambda m: f"{m['peak_gpu_mb']:.0f} GPU" if m["peak_gpu_mb"] is not None else f"{m['peak_rss_mb']:.0f} RSS"
        print(f"| {shape['shape']} | {shape['parameters'] / 1e6:.1f}M | {t['dtype']} | {t['step_s_median']:.3f} | "
              f"{t['computed_tokens_per_s']:.0f} | {t['logical_tokens_per_s']:.0f} | {memory(t)} | "
              f"{t['plan_trainer_peak_mb']:.0f} | {t['merge']['merge_s']:.1f} | "
              + " | ".join(f"{r['tokens_per_s']:.1f}" for r in d["rounds"]) + f" | {memory(d)} | "
              + (f"{a['mismatch_kl']:.2g} | {a['mismatch_abs_max']:.2g} | {a['step']['measured_peak_mb']:.0f} | {a['step']['plan_mb']:.0f} |"
                 if a is not None else "– | – | – | – |"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when visible)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes and work: the CPU smoke version")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="the trainer's and the servers' weights (auto: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--shapes", default=None, help="comma-separated subset of the Llama shape names")
    p.add_argument("--families", default=None,
                   help="'all' or comma-separated families (qwen3, qwen2.5, gemma3, gptoss, llama3, mistral): their real "
                        "architectures and tokenizers (make install-model-files), instead of the Llama shapes")
    p.add_argument("--sizes", default="0.5b", help="family model sizes: tiny, 0.5b, 1.5b, 8b (--tiny: tiny)")
    p.add_argument("--groups", type=int, default=None)
    p.add_argument("--group-size", type=int, default=None)
    p.add_argument("--prompt-tokens", type=int, default=None)
    p.add_argument("--completion-tokens", type=int, default=None)
    p.add_argument("--micro-batch-tokens", type=int, default=2048, help="packing budget (LocalBackend's default)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--decode-tokens", type=int, default=None)
    p.add_argument("--decode-prompt-tokens", type=int, default=None)
    p.add_argument("--agreement-groups", type=int, default=None, help="groups sampled and trained for the mismatch (0: no agreement stage)")
    p.add_argument("--agreement-tokens", type=int, default=None, help="tokens sampled per completion for the mismatch")
    p.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget for all shapes")
    p.add_argument("--in-process", action="store_true", help="run the shapes in this process (default with --tiny)")
    p.add_argument("--json", default="bench/results/gpu_check.json", help="where the raw results go")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    defaults = dict(groups=2, group_size=4, prompt_tokens=16, completion_tokens=8, steps=2, decode_tokens=4,
                    decode_prompt_tokens=8, agreement_groups=1, agreement_tokens=8) if args.tiny else dict(
                    groups=4, group_size=8, prompt_tokens=512, completion_tokens=256, steps=3, decode_tokens=64,
                    decode_prompt_tokens=256, agreement_groups=2, agreement_tokens=64)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.worker:
        worker(args)
        return
    shapes = targets(args)
    names = list(shapes)
    started = time.perf_counter()
    report: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "worker"},
                              "environment": environment(args.device), "shapes": []}
    argv = [a for a in sys.argv[1:]]
    for name in names:
        print(f"{name} ...", flush=True)
        if args.in_process or args.tiny:
            try:
                report["shapes"].append(run_shape(name, shapes[name], args))
            except Exception as error:  # noqa: BLE001 - reported in the table and the JSON
                report["shapes"].append({"shape": name, "error": f"{type(error).__name__}: {error}"})
        else:
            report["shapes"].append(_run_isolated(name, argv, args.budget_s - (time.perf_counter() - started)))
    report["wall_s"] = time.perf_counter() - started
    report["vllm_imported"] = "vllm" in sys.modules or any(s.get("vllm_imported") for s in report["shapes"])
    print_table(report)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"\nraw results: {args.json}")
    if any("error" in s for s in report["shapes"]):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
