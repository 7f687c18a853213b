"""A minimal GRPO loop in one file, top to bottom: executable documentation of what tracerl does.

    python -m tracerl.train.reference_loop --steps 20

Each step it

1. takes a few tasks of a tiny verifiable problem ("What is 3 + 5? Reply with the number only."),
2. samples a group of G completions per task with ``model.generate``, keeping the sampled token
   ids and the sampler's logprob of each,
3. scores every completion (1 if its last number is the sum, 0.2 for another number, 0 for none),
4. turns rewards into advantages per group: ``(r - mean) / (std + 1e-6)``; a group whose
   rewards are all equal carries no signal and is skipped,
5. computes the GRPO loss the plain way (:func:`reference_loss`): every trajectory one padded
   row ``prompt + completion``, full logits, log-softmax, the completion tokens' logprobs, the
   PPO-clip or CISPO loss per token, each trajectory's mean token loss, the mean over
   trajectories (so every trajectory weighs the same whatever its length),
6. takes one AdamW step on the LoRA and prints the mean reward.

On single-turn data it computes the same loss and gradients as the real path
(``LocalBackend.train``: tokenization, prefix-sharing packing, chunked logprobs,
``LoRATrainer.step``); ``tests/test_reference_loop.py`` uses :func:`reference_loss` as the
oracle for that.  It imports only tracerl's base-model resolution, not its GRPO math.

Simplifications compared with the real trainer (on purpose, for readability):

- single turn only: one prompt and one sampled completion per trajectory; no multi-turn
  append-only sequences, tool calls, observation tokens, prefix breaks or retokenization;
- sampling with ``model.generate`` in this process, on the model being trained: no vLLM or
  transformers inference server, no OpenAI protocol, no capture, no adapter hot-loading;
- no packing and no prefix sharing: the group's shared prompt is recomputed in every row,
  and padding costs compute;
- the full ``[B, T, V]`` logits are materialised (every position, prompt included) instead
  of chunked logprobs with activation checkpointing on the trained positions only;
- one micro-batch per step: no gradient accumulation, no token budget per micro-batch;
- token-level importance ratios only (no GSPO sequence level), no KL penalty to the base
  model, no clamp on the log-ratio, non-finite gradients are not skipped;
- no checkpoints, no resume, no ``history.jsonl`` or trajectory files, no diagnostics
  beyond reward and loss (no entropy, ratio statistics, clipped fraction or
  sampler-vs-trainer probability correlation);
- a fixed toy task and reward defined here: no RULER, no datasets, no error handling.
"""

from __future__ import annotations

import argparse
import random
import re
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from ..base_models import resolve_base_model

TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DEFAULT_EPSILON = {"ppo": (0.2, 0.2), "cispo": (1.0, 4.0)}  # (low, high): clip ratio to [1 - low, 1 + high]


# ---------------------------------------------------------------------------------------------
# 1. The task: a question with a verifiable answer, and its reward.
# ---------------------------------------------------------------------------------------------
def make_task(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return f"What is {a} + {b}? Reply with the number only.", a + b


def reward_fn(text: str, answer: int) -> float:
    """1 if the last number written is the answer, 0.2 for another number (a little shaping), else 0."""
    numbers = re.findall(r"-?\d+", text)
    if not numbers:
        return 0.0
    return 1.0 if int(numbers[-1]) == answer else 0.2


# ---------------------------------------------------------------------------------------------
# 2. The policy: the base model in fp32 with a fresh LoRA (only the LoRA is trained).
# ---------------------------------------------------------------------------------------------
def load_policy(base_model: str = "smollm2-135m", rank: int = 8, alpha: int = 16):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_base_model(base_model)  # the embedded SmolLM2-135M, converted once, offline
    tokenizer = AutoTokenizer.from_pretrained(path)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=TARGET_MODULES, task_type="CAUSAL_LM")
    return get_peft_model(base, config), tokenizer


def prompt_ids_for(tokenizer, question: str) -> list[int]:
    """The chat template rendered to text, then tokenized (as the inference servers do)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# ---------------------------------------------------------------------------------------------
# 3. Sampling: G completions of one prompt, with the sampled ids and their logprobs.
# ---------------------------------------------------------------------------------------------
@dataclass
class Rollout:
    prompt_ids: list[int]
    completion_ids: list[int]
    """Sampled token ids, the stop token included when one was sampled."""
    logprobs: list[float]
    """The sampler's logprob of each completion token (the "old" policy of the ratio)."""
    text: str
    reward: float = 0.0


@torch.no_grad()
def sample_group(model, tokenizer, question: str, group_size: int, max_new_tokens: int) -> list[Rollout]:
    prompt_ids = prompt_ids_for(tokenizer, question)
    model.eval()
    out = model.generate(
        input_ids=torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        do_sample=True,
        temperature=1.0,  # sample from the policy itself: no temperature, top-k or top-p
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        num_return_sequences=group_size,
        output_logits=True,  # the raw logits at each sampled position
        return_dict_in_generate=True,
        pad_token_id=tokenizer.pad_token_id,
    )
    sampled_GT = out.sequences[:, len(prompt_ids) :]
    logits_GTV = torch.stack(out.logits, dim=1).float()
    logprobs_GT = logits_GTV.log_softmax(-1).gather(-1, sampled_GT[..., None]).squeeze(-1)
    rollouts = []
    for ids, logprobs in zip(sampled_GT.tolist(), logprobs_GT.tolist()):
        n = ids.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in ids else len(ids)  # drop padding
        text = tokenizer.decode(ids[:n], skip_special_tokens=True)
        rollouts.append(Rollout(prompt_ids, ids[:n], logprobs[:n], text))
    return rollouts


# ---------------------------------------------------------------------------------------------
# 4. Advantages: mean-centred, std-scaled, per group.
# ---------------------------------------------------------------------------------------------
def group_advantages(rewards_G: Sequence[float], std_eps: float = 1e-6) -> list[float] | None:
    """``(r - mean) / (std + eps)`` for each member, or None when the group carries no signal."""
    rewards = torch.tensor(list(rewards_G), dtype=torch.float64)
    if len(rewards) < 2 or float(rewards.max() - rewards.min()) <= 1e-12:
        return None  # all equal: every advantage would be 0
    return ((rewards - rewards.mean()) / (rewards.std(unbiased=False) + std_eps)).tolist()


# ---------------------------------------------------------------------------------------------
# 5. The GRPO loss, plainly.
# ---------------------------------------------------------------------------------------------
def completion_logprobs(
    model, prompt_ids_B: Sequence[list[int]], completion_ids_B: Sequence[list[int]], pad_token_id: int = 0
) -> list[torch.Tensor]:
    """The current policy's logprob of each completion token, one tensor per trajectory."""
    rows = [list(p) + list(c) for p, c in zip(prompt_ids_B, completion_ids_B)]
    B, T = len(rows), max(len(r) for r in rows)
    input_ids_BT = torch.full((B, T), pad_token_id, dtype=torch.long)
    attention_BT = torch.zeros((B, T), dtype=torch.long)
    for b, row in enumerate(rows):  # right padding: real tokens never see the padding
        input_ids_BT[b, : len(row)] = torch.tensor(row)
        attention_BT[b, : len(row)] = 1
    logits_BTV = model(input_ids=input_ids_BT, attention_mask=attention_BT).logits.float()
    # the output at position t predicts token t + 1
    logprobs_BTV = logits_BTV[:, :-1].log_softmax(dim=-1)
    token_logprobs_BT = logprobs_BTV.gather(-1, input_ids_BT[:, 1:, None]).squeeze(-1)
    out = []
    for b, (prompt, completion) in enumerate(zip(prompt_ids_B, completion_ids_B)):
        start = len(prompt) - 1  # the position predicting the first completion token
        out.append(token_logprobs_BT[b, start : start + len(completion)])
    return out


def reference_loss(
    model,
    prompt_ids_B: Sequence[list[int]],
    completion_ids_B: Sequence[list[int]],
    old_logprobs_B: Sequence[Sequence[float]],
    advantages_B: Sequence[float],
    *,
    loss_fn: str = "cispo",
    epsilon: float | None = None,
    epsilon_high: float | None = None,
    pad_token_id: int = 0,
) -> torch.Tensor:
    """The GRPO loss of a batch of trajectories: the mean over trajectories of their mean token loss.

    Per token, with ratio ``ρ = exp(logπ - logπ_old)`` clipped to ``[1 - ε, 1 + ε_high]``:

    - ``ppo``:   ``-min(ρ·A, clip(ρ)·A)`` (no gradient once the ratio left the trust region);
    - ``cispo``: ``-sg(clip(ρ))·A·logπ`` (the clipped ratio is a weight, every token keeps a gradient).
    """
    eps_low, eps_high = DEFAULT_EPSILON[loss_fn]
    if epsilon is not None:
        eps_low = epsilon
        if loss_fn == "ppo":
            eps_high = epsilon  # PPO's clip is symmetric unless told otherwise
    if epsilon_high is not None:
        eps_high = epsilon_high
    logprobs_B = completion_logprobs(model, prompt_ids_B, completion_ids_B, pad_token_id)
    per_trajectory = []
    for logprobs_T, old, advantage in zip(logprobs_B, old_logprobs_B, advantages_B):
        old_T = torch.tensor(list(old), dtype=torch.float32)
        ratio_T = torch.exp(logprobs_T - old_T)
        clipped_T = ratio_T.clamp(1.0 - eps_low, 1.0 + eps_high)
        if loss_fn == "ppo":
            loss_T = -torch.minimum(ratio_T * advantage, clipped_T * advantage)
        elif loss_fn == "cispo":
            loss_T = -clipped_T.detach() * advantage * logprobs_T
        else:
            raise ValueError(f"loss_fn must be 'ppo' or 'cispo', got {loss_fn!r}")
        per_trajectory.append(loss_T.mean())
    return torch.stack(per_trajectory).mean()


# ---------------------------------------------------------------------------------------------
# 6. One step and the loop.
# ---------------------------------------------------------------------------------------------
def grpo_step(model, optimizer, groups: list[list[Rollout]], *, loss_fn: str, max_grad_norm: float, pad_token_id: int) -> dict:
    batch = []  # (rollout, advantage) for every member of a group with signal
    trainable = 0
    for group in groups:
        advantages = group_advantages([r.reward for r in group])
        if advantages is not None:
            batch += list(zip(group, advantages))
            trainable += 1
    if not batch:
        return {"loss": 0.0, "grad_norm": 0.0, "trainable_groups": 0}
    model.train()
    loss = reference_loss(
        model,
        [r.prompt_ids for r, _ in batch],
        [r.completion_ids for r, _ in batch],
        [r.logprobs for r, _ in batch],
        [a for _, a in batch],
        loss_fn=loss_fn,
        pad_token_id=pad_token_id,
    )
    optimizer.zero_grad()
    loss.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    optimizer.step()
    return {"loss": float(loss.detach()), "grad_norm": float(grad_norm), "trainable_groups": trainable}


def main(argv: Sequence[str] | None = None) -> list[float]:
    """Run the loop; return the mean reward of each step."""
    p = argparse.ArgumentParser(description="A minimal GRPO loop (see the module docstring).")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--base-model", default="smollm2-135m")
    p.add_argument("--groups-per-step", type=int, default=2)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--loss-fn", choices=["cispo", "ppo"], default="cispo")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-grad-norm", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    model, tokenizer = load_policy(args.base_model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    mean_rewards = []
    for step in range(1, args.steps + 1):
        started = time.monotonic()
        groups = []
        for question, answer in (make_task(rng) for _ in range(args.groups_per_step)):
            group = sample_group(model, tokenizer, question, args.group_size, args.max_new_tokens)
            for rollout in group:
                rollout.reward = reward_fn(rollout.text, answer)
            groups.append(group)
        stats = grpo_step(
            model, optimizer, groups, loss_fn=args.loss_fn, max_grad_norm=args.max_grad_norm, pad_token_id=tokenizer.pad_token_id
        )
        rewards = [r.reward for g in groups for r in g]
        mean_rewards.append(sum(rewards) / len(rewards))
        print(
            f"step {step}/{args.steps}  reward {mean_rewards[-1]:.3f}  loss {stats['loss']:+.4f}"
            f"  trainable groups {stats['trainable_groups']}/{len(groups)}  {time.monotonic() - started:.1f}s",
            flush=True,
        )
    return mean_rewards


if __name__ == "__main__":
    main()
