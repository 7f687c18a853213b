"""A tiny single-turn arithmetic environment written with verifiers' own v1 API.

Run it with ``run_rollout.py`` (same folder) from the verifiers venv, not tracerl's: verifiers
pins ``openai<3`` and ``mcp==2.0.0``.

This module is a verifiers *taskset plugin*: verifiers loads it by id (``arithmetic_env``, the
module name, which must be importable) and takes from ``__all__`` its ``Taskset`` subclass and,
optionally, a ``Harness`` subclass, which then becomes the default harness for this taskset. It
is the layout that ``vf-init`` scaffolds, folded into a single file.

* ``ArithmeticTaskset`` yields 50 fixed "What is A + B?" tasks (A, B in 0..20, seeded).
* ``ArithmeticTask`` scores a finished trace: the ``correct`` reward (1.0 when the last integer
  in the reply equals A + B) and the ``has_number`` metric.
* ``ArithmeticHarness`` is the agent program. The built-in ``null``/``bash`` chat harnesses are
  PEP 723 scripts that verifiers prepares with ``uv sync`` at run time (installing uv and
  downloading packages when they are missing); this one sends the single chat request in-process
  instead, which the ``Harness.launch`` contract allows, as long as the call goes to verifiers'
  interception ``endpoint``, which forwards it to the real model and records it on the trace.
"""

from __future__ import annotations

import random
import re

import openai
import verifiers.v1 as vf

__all__ = ["ArithmeticHarness", "ArithmeticTaskset"]

_INT = re.compile(r"-?\d+")


def last_int(text: str) -> int | None:
    """The last integer written in ``text`` (``"12 + 3 = 15."`` -> 15), or None."""
    found = _INT.findall(text.replace(",", ""))
    return int(found[-1]) if found else None


class ArithmeticData(vf.TaskData):
    """One task's data (it rides on the trace as ``trace.task.data``)."""

    a: int
    b: int


class ArithmeticTask(vf.Task[ArithmeticData]):
    """Scoring for one task, run by verifiers after the rollout ends."""

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        """1.0 when the last integer of the model's reply is A + B, else 0.0."""
        return 1.0 if last_int(trace.last_reply) == self.data.a + self.data.b else 0.0

    @vf.metric
    async def has_number(self, trace: vf.Trace) -> float:
        """1.0 when the reply contains any integer at all (recorded, not added to the reward)."""
        return 0.0 if last_int(trace.last_reply) is None else 1.0


class ArithmeticConfig(vf.TasksetConfig):
    num_tasks: int = 50
    """How many tasks ``load`` yields."""
    seed: int = 0
    """Seed of the operands: the same seed always gives the same tasks."""


class ArithmeticTaskset(vf.Taskset[ArithmeticTask, ArithmeticConfig]):
    def load(self) -> list[ArithmeticTask]:
        rng = random.Random(self.config.seed)
        tasks = []
        for i in range(self.config.num_tasks):
            a, b = rng.randint(0, 20), rng.randint(0, 20)
            data = ArithmeticData(
                name=f"add-{i}",
                prompt=f"What is {a} + {b}? Answer with the number only.",
                a=a,
                b=b,
            )
            tasks.append(ArithmeticTask(data, self.config.task))
        return tasks


class ArithmeticHarnessConfig(vf.HarnessConfig):
    request_timeout: float = 150.0
    """Seconds the in-process chat request to the interception endpoint may take. Keep it above
    the upstream client's timeout so that an upstream failure is the error reported."""


class ArithmeticHarness(vf.Harness[ArithmeticHarnessConfig]):
    """One chat-completions request, sent in-process: no program to install, no tools."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False  # the model runs nothing: no "subprocess on the host" warning
    NEEDS_CONTAINER = False  # so the local subprocess runtime is allowed

    async def launch(
        self,
        ctx: vf.ModelContext,
        trace: vf.Trace,
        runtime: vf.Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: vf.TaskData,
    ) -> vf.ProgramResult:
        system, prompt = self.resolve_text_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt or ""})
        # `endpoint` is verifiers' local interception server, not the model: it imposes the
        # run's model and sampling settings, forwards to the real endpoint, and records the
        # turn on `trace`; the reply itself is read from the trace, so nothing is kept here.
        async with openai.AsyncOpenAI(
            base_url=endpoint,
            api_key=secret,
            timeout=self.config.request_timeout,
            max_retries=0,
        ) as client:
            await client.chat.completions.create(model=ctx.model, messages=messages)
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")
