"""MCP•RL: point tracerl at any MCP server; it discovers the tools, writes practice tasks,
runs the agent, judges it (RULER, or a check in code) and trains it.

- ``server``: :class:`McpServerSpec` (stdio command or streamable-HTTP URL),
  ``open_session`` and ``discover`` (tools, resources).
- ``scenarios``: ``generate_scenarios`` (an LLM writes N tasks as strict JSON; tolerant
  parse, one corrective re-ask, dedupe, on-disk cache) and JSONL save/load.
- ``agent``: ``run_mcp_agent``, an OpenAI-client tool loop over the MCP tools inside
  ``tracerl.rollout`` (capture builds the trajectory, token ids included).
- ``judges``: ``ExpectedAnswerJudge``, a verifiable ``Judge`` (a reward function in code,
  e.g. the final answer against ``Scenario.metadata["answer"]``), and ``as_after_each``.
- ``train``: ``train_mcp_agent``, the recipe (discover → scenarios (given or generated) →
  gather groups → judge (RULER or any ``Judge``) → ``backend.train`` → ``model.log``),
  resumable; ``tracerl mcp-rl`` on the CLI.
- ``checked``: the loop of a checked-answer example (tasks and answers in code, a shaped reward
  for the right tool call, train, print held-out start → end, plot), shared by
  ``examples/mcp_rl_calculator.py`` and ``examples/mcp_rl_time_checked.py``.

Importing this package is light: the ``mcp`` SDK and LiteLLM load on first use.
"""

from __future__ import annotations

from .agent import DEFAULT_SYSTEM_PROMPT, openai_tools, run_mcp_agent
from .judges import ExpectedAnswerJudge, Reward, as_after_each, final_answer, final_answer_matches, task_of
from .scenarios import Scenario, ScenarioError, generate_scenarios, load_scenarios, parse_scenarios, save_scenarios
from .server import Discovery, McpResource, McpServerError, McpServerSpec, McpTool, discover, open_session
from .train import McpRLResult, prepare_scenarios, train_mcp_agent, train_mcp_agent_locally

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "Discovery",
    "ExpectedAnswerJudge",
    "McpRLResult",
    "McpResource",
    "McpServerError",
    "McpServerSpec",
    "McpTool",
    "Scenario",
    "Reward",
    "ScenarioError",
    "as_after_each",
    "discover",
    "final_answer",
    "final_answer_matches",
    "generate_scenarios",
    "load_scenarios",
    "open_session",
    "openai_tools",
    "parse_scenarios",
    "prepare_scenarios",
    "run_mcp_agent",
    "save_scenarios",
    "task_of",
    "train_mcp_agent",
    "train_mcp_agent_locally",
]
