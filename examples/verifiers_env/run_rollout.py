"""Run ONE rollout of ``arithmetic_env`` against any OpenAI-compatible endpoint and print its score.

Usage (with the verifiers venv's python, not tracerl's: verifiers pins ``openai<3``, ``mcp==2.0.0``)::

    OPENAI_BASE_URL=http://host:8000/v1 OPENAI_API_KEY=... TRACERL_MODEL=my-model \\
        python run_rollout.py --task-index 3 [--temperature 0.7] [--max-tokens 64] [--timeout 120]

Prints exactly one JSON line on stdout::

    {"task_index": 3, "reward": 1.0, "metrics": {"has_number": 1.0}, "completion": "..."}

``reward`` and ``metrics`` are the environment's own: the rollout goes through verifiers' eval path
(``load_environment`` -> ``env.serving()`` -> ``env.run_episode``), as ``vf-eval`` does for one slot,
so the task's ``@vf.reward``/``@vf.metric`` methods score the trace. It runs in this process,
on verifiers' local ``subprocess`` runtime (a scratch folder under ~/.cache/verifiers, removed after
the rollout), never a hosted sandbox; the only outside network call is to OPENAI_BASE_URL, made by
verifiers' own client with timeouts. Logs go to stderr; on any failure (endpoint unreachable, an
HTTP error, a timeout, a task index out of range) the exit code is 1 with the reason on the last
stderr line; 2 when flags or environment variables are missing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path

import verifiers.v1 as vf

TASKSET_ID = "arithmetic_env"  # the module next to this file; verifiers imports it by this id

log = logging.getLogger("run_rollout")


class Failure(RuntimeError):
    """An expected failure (a bad task index; a rollout on which verifiers recorded errors:
    endpoint down, HTTP error, timeout): reported as one line, without a traceback."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task-index", type=int, required=True, help="index into the taskset (0..49)")
    parser.add_argument("--temperature", type=float, default=None, help="default: the endpoint's")
    parser.add_argument("--max-tokens", type=int, default=None, help="default: the endpoint's")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds, per request phase")
    return parser.parse_args()


def env_config(timeout: float) -> vf.EnvConfig:
    """The env config ``vf-eval arithmetic_env`` would build, pinned to the local runtime."""
    return vf.resolve_env_config(
        {
            "taskset": {"id": TASKSET_ID},
            "agent": {
                # The default runtime is Prime's hosted sandbox; run in a local scratch folder.
                "runtime": {"type": "subprocess"},
                # Above the upstream timeouts, so an upstream failure is what gets reported.
                "harness": {"id": TASKSET_ID, "request_timeout": timeout + 30},
                # Backstops for the whole solve attempt and for the scoring hooks.
                "timeout": {"setup": timeout, "rollout": timeout + 60, "scoring": timeout},
            },
        }
    )


def model_context(args: argparse.Namespace, base_url: str, model: str, timeout: float) -> vf.ModelContext:
    """The model under test: a plain OpenAI-compatible endpoint, key read from OPENAI_API_KEY."""
    client = vf.EvalClientConfig(
        base_url=base_url,
        api_key_var="OPENAI_API_KEY",  # any var other than PRIME_API_KEY: no Prime config lookup
        timeout={"connect": timeout, "read": timeout, "write": timeout, "pool": timeout},
    )
    sampling = vf.SamplingConfig(temperature=args.temperature, max_tokens=args.max_tokens)
    return vf.ModelContext(model=model, client=client, sampling=sampling)


async def run_one(args: argparse.Namespace, base_url: str, model: str) -> dict:
    env = vf.load_environment(env_config(args.timeout))
    tasks = list(env.taskset)
    if not 0 <= args.task_index < len(tasks):
        raise Failure(f"--task-index must be in 0..{len(tasks) - 1}, got {args.task_index}")
    task = tasks[args.task_index]
    log.info("task %d: %s (model %s at %s)", args.task_index, task.data.prompt, model, base_url)
    async with env.serving():  # the local interception server that relays model calls
        episode = await env.run_episode(task, model_context(args, base_url, model, args.timeout))
    errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
    if not episode.ok or not episode.traces or errors:
        detail = "; ".join(_describe(e) for e in errors) or "no trace"
        raise Failure(f"rollout failed: {detail}")
    (trace,) = episode.traces  # the single-agent env: one trace per episode
    return {
        "task_index": args.task_index,
        "reward": float(trace.reward),  # the weighted sum of the task's @vf.reward scores
        "metrics": trace.metrics,  # the task's @vf.metric values, by name
        "completion": trace.last_reply,  # the text the rewards were computed from
    }


def _describe(error: vf.Error) -> str:
    """One recorded error as text; a timeout's message can be empty, its HTTP status is not."""
    status = f" (HTTP {error.status_code})" if error.status_code else ""
    return f"{error.type}{status}: {error.message or 'no message (504 = timed out)'}"


def main() -> int:
    args = parse_args()
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    base_url, model = os.environ.get("OPENAI_BASE_URL"), os.environ.get("TRACERL_MODEL")
    if not base_url or not model:
        print("error: set OPENAI_BASE_URL and TRACERL_MODEL (and OPENAI_API_KEY if needed)", file=sys.stderr)
        return 2
    # verifiers resolves a taskset id by importing it; make this folder importable wherever we run from.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    try:
        result = asyncio.run(run_one(args, base_url, model))
    except Exception as e:  # the CLI's contract: a clear message and a non-zero exit
        if not isinstance(e, Failure):
            log.exception("unexpected failure")  # a bug, not a model failure: keep its traceback
        print(f"error: {e}" if isinstance(e, Failure) else f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
