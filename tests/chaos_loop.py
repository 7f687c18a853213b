"""The chaos child: a real, tiny ``LocalBackend`` training loop that :mod:`chaos` SIGKILLs and reruns.

    python tests/chaos_loop.py --data DIR --markers FILE --steps N [--kill PHASE:MODE:VALUE] [--pipelined] [--base-model M]

SmolLM2-135M (``--base-model``: another, e.g. the suite's tiny random Llama folder) served by
the transformers server: per step two groups of two rollouts (real generation, a few tokens),
``backend.train`` (a real GRPO step, save, hot-load),
``model.log(split="train")``, then a greedy val eval and ``model.log(split="val")``.  The
loop is the README's and ``examples/demo.py``'s (resume at ``get_step``, val when not yet
logged for the step), so a rerun after any kill must finish the run with nothing lost.
``--pipelined`` runs the same rollouts, steps and evals through ``tracerl.PipelineTrainer``
(``max_staleness=1``: rollouts run on while a step trains), which resumes by itself.

Each phase appends ``{"pid", "phase", "step", "event": "start"|"end"}`` to the marker file
(one unbuffered write), so the driver knows where a kill landed.  ``--kill`` makes the
child SIGKILL itself inside the first occurrence of a phase: ``save:op:3`` before the 3rd
file operation of the commit (``os.rename``/``replace``/``fsync``/``write``/``unlink``/
``rmdir``), ``hotload:delay:0.2`` 0.2 s into the hot-load (by a timer thread).  A phase that
ends before its kill fired is killed at its end, still inside it.  These hooks are this
test script's own patches; tracerl has no crash hooks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Iterator

import tracerl

PROMPTS = ["Name a fruit.", "Say hello.", "Count to three.", "Name a colour.", "Say a number.", "Greet me."]
VAL_PROMPTS = ["Name an animal.", "Say goodbye."]
GROUPS, ROLLOUTS, MAX_TOKENS = 2, 2, 8
FILE_OPS = ("rename", "replace", "fsync", "write", "unlink", "rmdir")
_real_write = os.write


class Phases:
    """Phase markers plus this run's planned self-kill."""

    def __init__(self, markers: Path, kill: str | None) -> None:
        self.fd = os.open(markers, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.kill_phase, self.kill_mode, self.kill_value = (kill.split(":") if kill else (None, None, None))
        self.armed = False
        self.ops_left = 0
        self.stack: list[tuple[str, int]] = []  # phases nest: save and hotload happen inside train
        for op in FILE_OPS:
            self._count_op(op)

    def mark(self, **fields: object) -> None:
        _real_write(self.fd, (json.dumps({"pid": os.getpid(), "t": time.time(), **fields}) + "\n").encode())

    def die(self, how: str) -> None:
        phase, step = self.stack[-1] if self.stack else (self.kill_phase, -1)
        self.mark(phase=phase, step=step, event="kill", how=how)
        os.kill(os.getpid(), signal.SIGKILL)

    @contextlib.contextmanager
    def phase(self, name: str, step: int) -> Iterator[None]:
        self.stack.append((name, step))
        self.mark(phase=name, step=step, event="start")
        if name == self.kill_phase and not self.armed:
            self.armed = True
            if self.kill_mode == "delay":
                delay = float(self.kill_value)
                threading.Timer(delay, self.die, args=(f"timer {delay:.3f}s",)).start()
            else:
                self.ops_left = int(self.kill_value)
        yield
        if self.armed and name == self.kill_phase:
            self.die("end of phase")
        self.mark(phase=name, step=step, event="end")
        self.stack.pop()

    def _count_op(self, op: str) -> None:
        real = getattr(os, op)

        def patched(*args, **kwargs):
            if self.armed and self.kill_mode == "op" and self.stack and self.stack[-1][0] == self.kill_phase:
                self.ops_left -= 1
                if self.ops_left <= 0:
                    self.die(f"before {op} (file operation {self.kill_value} of the phase)")
            return real(*args, **kwargs)

        setattr(os, op, patched)


def instrument(phases: Phases, steps: dict[str, int]) -> None:
    """Mark the commit (inside ``backend.train``) and the hot-load as phases of their own."""
    import tracerl.train.local_backend as lb
    from tracerl.inference.transformers_server import TransformersServer

    commit = lb._commit_step

    def marked_commit(run_dir, step, *args, **kwargs):
        with phases.phase("save", step):
            return commit(run_dir, step, *args, **kwargs)

    load = TransformersServer.load_adapter

    async def marked_load(self, name, path):
        in_train = bool(phases.stack) and phases.stack[-1][0] == "train"  # not the load at register
        with phases.phase("hotload" if in_train else "load_adapter", steps["current"]):
            return await load(self, name, path)

    lb._commit_step = marked_commit
    TransformersServer.load_adapter = marked_load


async def rollout(model: tracerl.TrainableModel, prompt: str, temperature: float) -> tracerl.Trajectory:
    messages = [{"role": "user", "content": prompt}]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(),
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=temperature,
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    choice = tracerl.Choice.from_openai(completion.choices[0], completion)
    text = choice.message.get("content") or ""
    return tracerl.Trajectory(messages_and_choices=[*messages, choice], reward=-abs(len(text) - 20) / 20)


def logged(model: tracerl.Model, split: str, step: int) -> bool:
    return any(row.get("step") == step and f"{split}/reward" in row for row in model.history())


async def evaluate(model: tracerl.TrainableModel, phases: Phases, step: int) -> None:
    if logged(model, "val", step):
        return
    with phases.phase("val", step):
        groups = [tracerl.TrajectoryGroup([await rollout(model, p, 0.0)]) for p in VAL_PROMPTS]
    with phases.phase("log_val", step):
        await model.log(groups, split="val", step=step)


class MarkedBackend:
    """``backend.train`` marked as the ``train`` phase (the pipelined loop calls it itself)."""

    def __init__(self, backend: tracerl.LocalBackend, phases: Phases, steps: dict[str, int]) -> None:
        self.backend, self.phases, self.steps = backend, phases, steps

    async def train(self, model: tracerl.TrainableModel, groups, **kwargs) -> tracerl.TrainResult:
        self.steps["current"] = await model.get_step() + 1
        with self.phases.phase("train", self.steps["current"]):
            return await self.backend.train(model, groups, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.backend, name)


async def pipelined(model: tracerl.TrainableModel, backend: tracerl.LocalBackend, phases: Phases, steps: dict[str, int], total: int) -> None:
    log = model.log

    async def marked_log(groups, *, split, **kwargs):
        with phases.phase(f"log_{split}", kwargs.get("step", -1)):
            return await log(groups, split=split, **kwargs)

    async def rollout_group(model: tracerl.TrainableModel, prompt: str, config: None) -> tracerl.TrajectoryGroup:
        return tracerl.TrajectoryGroup(rollout(model, prompt, 1.0) for _ in range(ROLLOUTS))

    async def val(model: tracerl.TrainableModel, step: int) -> list[tracerl.TrajectoryGroup]:
        with phases.phase("val", step):
            return [tracerl.TrajectoryGroup([await rollout(model, p, 0.0)]) for p in VAL_PROMPTS]

    model.log = marked_log  # type: ignore[method-assign]
    scenarios = (PROMPTS[i % len(PROMPTS)] for i in itertools.count())
    trainer = tracerl.PipelineTrainer(
        model, MarkedBackend(backend, phases, steps), rollout_group, scenarios, eval_fn=val, eval_every_n_steps=1,
        groups_per_step=GROUPS, max_steps=total, max_staleness=1, train_kwargs={"learning_rate": 1e-4},
    )  # fmt: skip
    await trainer.train()


async def main(args: argparse.Namespace) -> None:
    phases = Phases(args.markers, args.kill)
    steps = {"current": 0}
    instrument(phases, steps)
    model = tracerl.TrainableModel("chaos", "chaos", args.base_model, base_path=args.data, lora_config={"r": 8, "alpha": 16})
    backend = tracerl.LocalBackend(inference="transformers")
    with phases.phase("register", 0):
        await model.register(backend)
    if args.pipelined:
        try:
            await pipelined(model, backend, phases, steps, args.steps)
        finally:
            await backend.close()
        phases.mark(phase="done", step=await model.get_step(), event="end")
        return
    try:
        step = await model.get_step()
        await evaluate(model, phases, step)
        while step < args.steps:
            steps["current"] = step + 1
            with phases.phase("rollout", step + 1):
                prompts = [PROMPTS[(step * GROUPS + g) % len(PROMPTS)] for g in range(GROUPS)]
                groups = await tracerl.gather_trajectory_groups(
                    (tracerl.TrajectoryGroup(rollout(model, p, 1.0) for _ in range(ROLLOUTS)) for p in prompts), pbar_desc=None
                )
            with phases.phase("train", step + 1):
                result = await backend.train(model, groups, learning_rate=1e-4)
            with phases.phase("log_train", result.step):
                await model.log(groups, split="train", metrics=result.metrics, step=result.step)
            step = result.step
            await evaluate(model, phases, step)
    finally:
        await backend.close()
    phases.mark(phase="done", step=step, event="end")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--markers", type=Path, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--kill", default=None, help="PHASE:op:N or PHASE:delay:SECONDS")
    parser.add_argument("--pipelined", action="store_true", help="the loop is tracerl.PipelineTrainer")
    parser.add_argument("--base-model", default="smollm2-135m", help="the base model (a model folder or smollm2-135m)")
    asyncio.run(main(parser.parse_args()))
