"""The bf16 floor of train–inference agreement, with tracerl nowhere in the path.

SmolLM2-135M in bf16: transformers' own ``generate`` (one token at a time against its KV cache, as
a sampler decodes) against the same model's own ``forward`` over the finished sequence (as a
trainer computes it), for each attention implementation: the mean k3 estimate of KL(decode ‖
forward) over the sampled tokens and the largest |Δ logprob|.  Whatever tracerl's trainer and
servers do, their bf16 agreement cannot beat this (docs/supported-models.md, the bf16 limit).

    .venv/bin/python bench/bf16_floor.py --json bench/results/bf16_floor.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tracerl.base_models import resolve_base_model

QUESTION = [{"role": "user", "content": "Name three colours and say why you like them."}]


def floor(model, prompt_ids: torch.Tensor, seed: int, *, tokens: int, temperature: float) -> tuple[float, float]:
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(prompt_ids, max_new_tokens=tokens, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                             output_logits=True, return_dict_in_generate=True)  # fmt: skip
        decoded = torch.stack(out.logits, 1)[0].float() / temperature
        n, start = decoded.shape[0], prompt_ids.shape[1]
        whole = model(out.sequences).logits[0, start - 1 : start - 1 + n].float() / temperature
        sampled = out.sequences[0, start : start + n, None]
        delta = (whole.log_softmax(-1).gather(-1, sampled) - decoded.log_softmax(-1).gather(-1, sampled))[:, 0]
    return float((delta.exp() - 1 - delta).mean()), float(delta.abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=60)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--json", help="write the raw results here")
    args = parser.parse_args()
    folder = resolve_base_model("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    rows = []
    print("| attention | mean KL(decode ‖ forward) | per seed | max abs Δ logprob |\n|---|---|---|---|")
    for implementation in ("sdpa", "eager"):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, attn_implementation=implementation).eval()
        seeds = [floor(model, prompt, seed, tokens=args.tokens, temperature=args.temperature) for seed in range(args.seeds)]
        kl = statistics.mean(k for k, _ in seeds)
        rows.append({"attention": implementation, "mean_kl": kl, "kl_per_seed": [k for k, _ in seeds], "max_abs": max(m for _, m in seeds)})
        print(f"| {implementation} | {kl:.2e} | {', '.join(f'{k:.1e}' for k, _ in seeds)} | {rows[-1]['max_abs']:.3f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": "smollm2-135m", "dtype": "bfloat16", **vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
