"""Which of TRL 1.16's transformers generation paths is fastest here, on time_to_reward's shape.

``GRPOTrainer`` without vLLM generates either with ``model.generate`` (a left-padded batch of
the step's rows, dynamic KV cache) or, with ``use_transformers_continuous_batching=True``, with
``model.generate_batch`` (transformers' paged-attention continuous batching).  This times both
on what ``bench/time_to_reward.py``'s TRL side generates each step: 8 rows of the demo's
first-turn prompt (409 tokens: system message, two worked examples, the task, the ``add``
tool), 40 new tokens at T=1, on the LoRA (r=16, all 7 projections) model, 3 repetitions each
(the first ``generate`` call includes warm-up).  TRL's vLLM paths are not candidates on this
machine: see ``bench/history/RESULTS-until-2026-12-04.md``, "Time to reward".

    flock /tmp/tracerl-heavy.lock .venv/bin/python bench/trl_generation.py
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import demo  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig  # noqa: E402

from tracerl.base_models import resolve_base_model  # noqa: E402

torch.manual_seed(0)
p = str(resolve_base_model("smollm2-135m"))
tok = AutoTokenizer.from_pretrained(p, padding_side="left")
m = AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)
m = get_peft_model(m, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], task_type="CAUSAL_LM"))
m.eval()
task = demo.make_tasks(0, 1)[0]
text = tok.apply_chat_template(demo.first_turn_messages(task), tools=[demo.ADD_TOOL], tokenize=False, add_generation_prompt=True)
ids = tok(text, add_special_tokens=False)["input_ids"]
print("prompt tokens", len(ids))
gc = GenerationConfig(max_new_tokens=40, min_new_tokens=40, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, disable_compile=True)  # fmt: skip
x = torch.tensor([ids] * 8)
with torch.no_grad():
    for rep in range(3):
        t = time.monotonic()
        out = m.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=gc)
        dt = time.monotonic() - t
        print(f"generate (dynamic KV cache, batch 8): {dt:.2f}s  {(out.shape[1] - x.shape[1]) * 8 / dt:.1f} tok/s", flush=True)
    from transformers.generation import ContinuousBatchingConfig

    for rep in range(3):
        t = time.monotonic()
        outs = m.generate_batch([ids] * 8, generation_config=gc, continuous_batching_config=ContinuousBatchingConfig(max_memory_percent=0.5), progress_bar=False)
        dt = time.monotonic() - t
        n = sum(len(o.generated_tokens) for o in outs.values())
        print(f"generate_batch (continuous batching, paged): {dt:.2f}s  {n / dt:.1f} tok/s", flush=True)
