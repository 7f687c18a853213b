"""Rollout throughput: tokens/s for 1 and 8 concurrent requests, base model and with a LoRA.

Compares the vLLM server (when its runtime is installed), tracerl's transformers server and
plain Hugging Face ``generate`` (batch 1 and 8) on SmolLM2-135M in fp32.  Every request
generates exactly ``--tokens`` tokens (``ignore_eos``), so the numbers compare like for like.
The LoRA is r=8 on the attention projections with random (nonzero) B weights.

    flock /tmp/tracerl-heavy.lock .venv/bin/python bench/rollout_throughput.py [--tokens 64] [--servers vllm,transformers,hf]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

PROMPTS = [f"Tell me a short story about a robot number {i}." for i in range(8)]


def make_adapter(model_path: Path, target: Path) -> str:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    peft_model.save_pretrained(target)
    return str(target)


async def bench_server(kind: str, model_path: Path, adapter: str, tokens: int) -> list[tuple]:
    from openai import AsyncOpenAI

    from tracerl.inference import make_server

    server = make_server(kind, model_path, served_name="bench")
    started = time.monotonic()
    await server.start()
    startup = time.monotonic() - started
    rows = []
    try:
        started = time.monotonic()
        await server.load_adapter("bench@1", adapter)
        load = time.monotonic() - started
        client = AsyncOpenAI(base_url=server.base_url, api_key=server.api_key, timeout=3600, max_retries=0)

        async def one(model: str, prompt: str) -> int:
            response = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=tokens,
                temperature=1.0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            return response.usage.completion_tokens

        for model, label in (("bench", "base"), ("bench@1", "LoRA")):
            await one(model, "warm up")
            for concurrency in (1, 8):
                started = time.monotonic()
                counts = await asyncio.gather(*[one(model, p) for p in PROMPTS[:concurrency]])
                seconds = time.monotonic() - started
                rows.append((f"{kind} server", label, concurrency, sum(counts), seconds))
                print(f"  {rows[-1][0]:<20} {label:<5} x{concurrency}: {sum(counts) / seconds:6.1f} tok/s", flush=True)
        print(f"  {kind}: start-up {startup:.1f} s, adapter load {load:.2f} s", flush=True)
    finally:
        await server.stop()
    return rows


def bench_hf(model_path: Path, adapter: str, tokens: int) -> list[tuple]:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.padding_side = "left"
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    rows = []
    for label in ("base", "LoRA"):
        model = base if label == "base" else PeftModel.from_pretrained(base, adapter).eval()
        for batch in (1, 8):
            texts = [
                tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
                for p in PROMPTS[:batch]
            ]
            inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.inference_mode():
                model.generate(**inputs, max_new_tokens=4, do_sample=True)  # warm up
                started = time.monotonic()
                out = model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True, top_k=0)
                seconds = time.monotonic() - started
            generated = (out.shape[1] - inputs["input_ids"].shape[1]) * batch
            rows.append(("HF generate", label, batch, generated, seconds))
            print(f"  {'HF generate':<20} {label:<5} x{batch}: {generated / seconds:6.1f} tok/s", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--servers", default="vllm,transformers,hf", help="comma-separated: vllm, transformers, hf")
    args = parser.parse_args()

    from tracerl.base_models import resolve_base_model
    from tracerl.inference.vllm_server import vllm_python

    model_path = resolve_base_model("smollm2-135m")
    wanted = args.servers.split(",")
    rows: list[tuple] = []
    with tempfile.TemporaryDirectory() as tmp:
        adapter = make_adapter(model_path, Path(tmp) / "adapter")
        for kind in ("vllm", "transformers"):
            if kind not in wanted:
                continue
            if kind == "vllm" and vllm_python() is None:
                print("  vllm: skipped (runtime not installed: python -m tracerl.inference.vllm_server install)")
                continue
            rows += asyncio.run(bench_server(kind, model_path, adapter, args.tokens))
        if "hf" in wanted:
            rows += bench_hf(model_path, adapter, args.tokens)
    reference = {(label, c): t / s for name, label, c, t, s in rows if name == "HF generate"}
    print(f"\nSmolLM2-135M fp32, {args.tokens} tokens per request, temperature 1\n")
    print("| path | model | concurrent | tokens | seconds | tokens/s | vs HF generate |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, label, concurrency, tokens, seconds in rows:
        rate = tokens / seconds
        ratio = rate / reference[(label, concurrency)] if (label, concurrency) in reference else float("nan")
        print(f"| {name} | {label} | {concurrency} | {tokens} | {seconds:.1f} | {rate:.1f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
