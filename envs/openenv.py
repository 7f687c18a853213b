"""OpenEnv environments as tracerl rollouts: the policy talks, OpenEnv's client steps the environment.

`OpenEnv <https://github.com/meta-pytorch/OpenEnv>`_ (``pip install openenv-core``) serves an
environment over HTTP and WebSockets (``create_fastapi_app(env_factory, Action, Observation)``
under uvicorn; no Docker needed on loopback) and talks to it with a gym-like async client
(``EnvClient`` / ``GenericEnvClient``: ``reset``, ``step``, each returning a ``StepResult``
with ``observation``, ``reward`` and ``done``).  :func:`openenv_episode` plays one episode
with the policy served by tracerl inside ``tracerl.rollout``, so every model turn is a
sampled turn with its token ids, and returns the trajectory with the episode's reward.

You choose how text becomes an action (``act``), how an observation becomes the next user
message (``observe``), and how the step rewards become the trajectory's reward (``reward``:
``"sum"``, ``"last"``, or a function of the list).  An environment server that fails (a
dropped connection, a timeout, an error answer) raises :class:`~tracerl.errors.InfrastructureError`:
the attempt is an exception in its group, never a trajectory to train on.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Sequence

from tracerl.errors import ConfigError, InfrastructureError
from tracerl.integrations import rollout

RewardRule = Literal["sum", "last"] | Callable[[Sequence[float]], float]


async def openenv_episode(
    model: Any,
    env: Any,
    *,
    first_messages: Callable[[Any], list[dict[str, Any]]],
    act: Callable[[str], Any],
    observe: Callable[[Any], str],
    max_turns: int = 8,
    reward: RewardRule = "sum",
    reset_kwargs: dict[str, Any] | None = None,
    completion_kwargs: dict[str, Any] | None = None,
    task: Any = None,
) -> Any:
    """Play one episode of the OpenEnv environment ``env`` (a connected ``EnvClient``) with ``model``.

    ``first_messages(observation)``: the conversation before the first turn, from the reset
    observation.  ``act(text)``: the action for the environment from the model's reply.
    ``observe(step_result)``: the next user message after a step that did not end the episode.
    The trajectory's ``metrics`` hold ``env_steps``, ``env_done`` (1 when the environment ended
    the episode, 0 when ``max_turns`` did) and ``env_reward_sum``; its ``metadata`` the step rewards.
    """
    if max_turns < 1:
        raise ConfigError(f"max_turns must be at least 1, got {max_turns}")
    combine = _reward_rule(reward)
    step_rewards: list[float] = []
    done = False
    async with rollout(model, task=task) as scope:
        start = await _env_call("reset", env.reset(**(reset_kwargs or {})))
        messages = list(first_messages(start.observation))
        client = model.openai_client()
        for _ in range(max_turns):
            completion = await client.chat.completions.create(
                model=model.get_inference_name(), messages=messages, **(completion_kwargs or {})
            )
            text = completion.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": text})
            result = await _env_call("step", env.step(act(text)))
            step_rewards.append(float(result.reward or 0.0))
            if result.done:
                done = True
                break
            messages.append({"role": "user", "content": observe(result)})
    trajectory = scope.trajectory
    trajectory.reward = combine(step_rewards)
    trajectory.metrics.update(env_steps=float(len(step_rewards)), env_done=float(done), env_reward_sum=float(sum(step_rewards)))
    trajectory.metadata["env_step_rewards"] = step_rewards
    return trajectory


def _reward_rule(reward: RewardRule) -> Callable[[Sequence[float]], float]:
    if reward == "sum":
        return lambda rewards: float(sum(rewards))
    if reward == "last":
        return lambda rewards: float(rewards[-1]) if rewards else 0.0
    if callable(reward):
        return lambda rewards: float(reward(rewards))
    raise ConfigError(f"reward must be 'sum', 'last' or a function of the step rewards, got {reward!r}")


async def _env_call(what: str, call: Any) -> Any:
    """An environment call whose failure is the infrastructure's, not the policy's (OpenEnv's client
    raises ``ConnectionError`` when it cannot connect, ``RuntimeError`` for the server's error
    answers, ``TimeoutError`` past its ``message_timeout_s``, websockets' errors when the link drops)."""
    from websockets.exceptions import WebSocketException

    try:
        return await call
    except (ConnectionError, TimeoutError, OSError, RuntimeError, WebSocketException) as error:
        raise InfrastructureError(f"the OpenEnv environment server failed on {what}: {type(error).__name__}: {error}") from error
