"""Rollout functions run as Ray tasks by tests/test_ray_rollouts.py (pickled by value: the workers
need not import this file).  Each fails, when it fails, for real: its own exception, its worker
process exiting, an inference server that is not there."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import openai


async def ask(model, prompt: str) -> float:
    """One model call through the model's endpoint; the reward is the answer's length."""
    import ray

    from tracerl.integrations.rollout import current_rollout

    current_rollout().metadata["node"] = ray.get_runtime_context().get_node_id()
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=[{"role": "user", "content": prompt}], max_tokens=3, temperature=1.0)
    return float(len(completion.choices[0].message.content or ""))


async def ask_for(model, prompt: str, reward: float) -> float:
    """One model call; the reward is given (so a group's rewards differ and it is trained on)."""
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=[{"role": "user", "content": prompt}], max_tokens=3, temperature=1.0)
    assert completion.choices[0].message is not None
    return reward


async def raises(model, prompt: str) -> float:
    raise ValueError(f"the task {prompt!r} makes this agent fail")


async def exits(model, prompt: str) -> float:
    os._exit(3)  # the worker process dies under the rollout


async def swallows(model, prompt: str) -> float:
    """Its model call fails (nothing listens there); the agent carries on as if nothing happened."""
    try:
        await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=[{"role": "user", "content": prompt}], max_tokens=3)
    except openai.APIConnectionError:
        pass
    return 1.0


async def hangs(folder: str) -> float:
    """Waits forever; notes when it started and when its ``finally`` ran (it was cancelled)."""
    Path(folder, "started").write_text("")
    try:
        await asyncio.sleep(3600)
    finally:
        Path(folder, "unwound").write_text("")
    return 0.0
