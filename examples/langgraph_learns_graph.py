"""The agent of ``langgraph_learns.py``: a plain LangGraph graph over a small SQLite database.

Nothing here knows about tracerl (this module imports nothing from it): it is the graph a
user already has, trained unchanged by ``langgraph_learns.py``.

The database (:func:`build_database`) holds a company: employees, each in a team, and teams
with a manager and a city.  A question asks for the manager or the city of someone's team,
so answering it takes two tool calls, the second using what the first returned:

    find_employee(name)  -> "Ada Novak works in team 7."
    team_manager(team_id) / team_city(team_id) -> "The manager of team 7 is Rui Costa." / "Team 7 works in Oslo."

The graph, written as LangGraph's docs write one::

    START -> router -> worker <-> tools      (ToolNode, at most MAX_TOOL_ROUNDS rounds)
                         |
                         v
                       answer -> END

- ``router`` reads the question, decides its kind (manager or city) and sets up the worker's
  conversation: instructions and three worked examples of that kind (small models copy the
  tool-call format from them);
- ``worker`` is the chat model with the three tools bound; ``tools`` runs the calls it makes
  (``ToolNode``), and a conditional edge sends it back to the worker, or on to ``answer`` when
  the worker stops calling tools (or has used its rounds);
- ``answer`` takes the worker's last reply as the answer.

:func:`score` checks an answer against the database (a verifiable reward, no judge).
"""

from __future__ import annotations

import json
import random
import re
import sqlite3
from pathlib import Path
from typing import Annotated, Any, Literal

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode
from typing_extensions import TypedDict

FIRST_NAMES = [
    "Ada", "Bruno", "Chloe", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Keiko", "Luca", "Maya",
    "Nils", "Olga", "Pablo", "Quinn", "Rosa", "Sami", "Tara", "Umar", "Vera", "Wes", "Xena", "Yusuf", "Zoe",
]  # fmt: skip
LAST_NAMES = ["Novak", "Costa", "Berg", "Ito", "Moreau", "Okafor", "Silva", "Weber", "Kowal", "Haddad", "Lind", "Rossi"]
CITIES = ["Oslo", "Lisbon", "Porto", "Lyon", "Turin", "Graz", "Gdansk", "Bergen", "Malmo", "Ghent", "Leeds", "Cork"]
MAX_TOOL_ROUNDS = 3
EXAMPLE_TEAMS = {"manager": (3, "Ivo Petrov", "Basel"), "city": (5, "Lena Vogt", "Seville")}
"""Teams that only the worked examples use (not in the database)."""


# -- the database ----------------------------------------------------------------------------
def build_database(path: str | Path, *, seed: int = 0, employees: int = 120, teams: int = 12) -> list[dict[str, Any]]:
    """Write the company database at ``path`` (replaced if present); return one task per employee.

    A task is ``{"question", "kind", "employee", "team_id", "expected"}``: ``expected`` is the
    manager's name or the team's city, read from the database.
    """
    rng = random.Random(seed)
    names = [f"{first} {last}" for first in FIRST_NAMES for last in LAST_NAMES]
    rng.shuffle(names)
    team_ids = rng.sample(range(10, 100), teams)
    managers = names[:teams]
    staff = names[teams : teams + employees]
    path = Path(path)
    path.unlink(missing_ok=True)
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE teams (id INTEGER PRIMARY KEY, manager TEXT NOT NULL, city TEXT NOT NULL)")
        db.execute("CREATE TABLE employees (name TEXT PRIMARY KEY, team_id INTEGER NOT NULL REFERENCES teams(id))")
        for team_id, manager in zip(team_ids, managers):
            db.execute("INSERT INTO teams VALUES (?, ?, ?)", (team_id, manager, rng.choice(CITIES)))
        for name in staff:
            db.execute("INSERT INTO employees VALUES (?, ?)", (name, rng.choice(team_ids)))
        rows = db.execute(
            "SELECT e.name, t.id, t.manager, t.city FROM employees e JOIN teams t ON t.id = e.team_id ORDER BY e.rowid"
        ).fetchall()
    tasks = []
    for i, (name, team_id, manager, city) in enumerate(rows):
        kind = "manager" if i % 2 == 0 else "city"
        tasks.append({
            "question": question(kind, name), "kind": kind, "employee": name, "team_id": team_id,
            "expected": manager if kind == "manager" else city,
        })  # fmt: skip
    return tasks


def question(kind: str, name: str) -> str:
    return f"Who is the manager of {name}'s team?" if kind == "manager" else f"In which city does {name}'s team work?"


def make_tools(db_path: str | Path) -> list[Any]:
    """The worker's three tools, each a read-only query of the database."""

    def query(sql: str, *args: Any) -> Any:
        with sqlite3.connect(f"file:{db_path}?mode=ro", uri=True) as db:
            return db.execute(sql, args).fetchone()

    @tool
    def find_employee(name: str) -> str:
        """Find an employee by full name; says which team they work in."""
        row = query("SELECT team_id FROM employees WHERE name = ?", str(name).strip())
        return f"{name} works in team {row[0]}." if row else f"No employee is named {name}."

    @tool
    def team_manager(team_id: int) -> str:
        """The manager of a team, by team id."""
        row = query("SELECT manager FROM teams WHERE id = ?", int(team_id))
        return f"The manager of team {team_id} is {row[0]}." if row else f"There is no team {team_id}."

    @tool
    def team_city(team_id: int) -> str:
        """The city a team works in, by team id."""
        row = query("SELECT city FROM teams WHERE id = ?", int(team_id))
        return f"Team {team_id} works in {row[0]}." if row else f"There is no team {team_id}."

    return [find_employee, team_manager, team_city]


# -- the graph ---------------------------------------------------------------------------------
class State(TypedDict, total=False):
    """The graph's state: the question, what the router made of it, the worker's conversation, the answer."""

    question: str
    kind: str
    messages: Annotated[list[Any], add_messages]
    tool_rounds: int
    answer: str


def instructions(kind: str) -> str:
    second = "team_manager" if kind == "manager" else "team_city"
    return (
        "You answer questions about the company's employees with tools. First call find_employee with the "
        f"person's full name, then call {second} with the team id it returns, then answer in one sentence."
    )


def worked_examples(kind: str) -> list[Any]:
    """Three solved questions of ``kind``, as a conversation the worker continues.

    Measured on SmolLM2-135M: with two, its replies at T=1 were almost never a well-formed
    call (greedy: half the first calls were right); small models copy the format from more.
    """
    team_id, manager, city = EXAMPLE_TEAMS[kind]
    second = "team_manager" if kind == "manager" else "team_city"
    messages: list[Any] = []
    for i, name in enumerate(["Mira Hale", "Otto Brandt", "Sofia Marin"]):
        first_id, second_id = f"call_{kind}_{i}_a", f"call_{kind}_{i}_b"
        result = f"The manager of team {team_id + i} is {manager}." if kind == "manager" else f"Team {team_id + i} works in {city}."
        final = f"The manager of {name}'s team is {manager}." if kind == "manager" else f"{name}'s team works in {city}."
        messages += [
            HumanMessage(question(kind, name)),
            AIMessage("", tool_calls=[{"name": "find_employee", "args": {"name": name}, "id": first_id}]),
            ToolMessage(f"{name} works in team {team_id + i}.", tool_call_id=first_id),
            AIMessage("", tool_calls=[{"name": second, "args": {"team_id": team_id + i}, "id": second_id}]),
            ToolMessage(result, tool_call_id=second_id),
            AIMessage(final),
        ]
    return messages


def build_graph(llm: Any, db_path: str | Path) -> Any:
    """The compiled graph: ``await graph.ainvoke({"question": ...})`` returns the final state."""
    tools = make_tools(db_path)
    worker_llm = llm.bind_tools(tools)

    def router(state: State) -> dict[str, Any]:
        kind = "manager" if "manager" in state["question"].lower() else "city"
        conversation = [SystemMessage(instructions(kind)), *worked_examples(kind), HumanMessage(state["question"])]
        return {"kind": kind, "messages": conversation, "tool_rounds": 0}

    async def worker(state: State) -> dict[str, Any]:
        return {"messages": [await worker_llm.ainvoke(state["messages"])]}

    def after_worker(state: State) -> Literal["tools", "answer"]:
        last = state["messages"][-1]
        wants_tools = isinstance(last, AIMessage) and bool(last.tool_calls)
        return "tools" if wants_tools and state.get("tool_rounds", 0) < MAX_TOOL_ROUNDS else "answer"

    tool_node = ToolNode(tools)

    async def run_tools(state: State) -> dict[str, Any]:
        out = await tool_node.ainvoke(state)
        return {**out, "tool_rounds": state.get("tool_rounds", 0) + 1}

    def answer(state: State) -> dict[str, Any]:
        last = state["messages"][-1]
        text = last.content if isinstance(last, AIMessage) and not last.tool_calls else ""
        return {"answer": text if isinstance(text, str) else json.dumps(text)}

    graph = StateGraph(State)
    graph.add_node("router", router)
    graph.add_node("worker", worker)
    graph.add_node("tools", run_tools)
    graph.add_node("answer", answer)
    graph.add_edge(START, "router")
    graph.add_edge("router", "worker")
    graph.add_conditional_edges("worker", after_worker)
    graph.add_edge("tools", "worker")
    graph.add_edge("answer", END)
    return graph.compile()


# -- the reward ----------------------------------------------------------------------------------
def score(state: dict[str, Any], task: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """A verifiable reward in [0, 1] from the final state, and its parts.

    0.1 × the share of the first call's pieces in the first reply (the tag, the tool's name,
    the arguments object, the person's name, the closing tag), +0.2 for ``find_employee``
    called with the right name, +0.1 for then calling the tool the question needs, +0.2 with
    the right team id, +0.4 for an answer that holds the expected manager or city.  The
    partial credit gives GRPO groups whose rewards differ from the first steps on; only the
    whole chain earns the answer's 0.4.
    """
    messages = state.get("messages") or []
    asked = max((i for i, m in enumerate(messages) if isinstance(m, HumanMessage)), default=-1)
    calls = [c for m in messages[asked + 1 :] if isinstance(m, AIMessage) for c in m.tool_calls]
    second = "team_manager" if task["kind"] == "manager" else "team_city"
    replies = [m for m in messages[asked + 1 :] if isinstance(m, AIMessage)]
    parts = {"call_format": _call_format(replies[0], task) if replies else 0.0, "find_employee": 0.0, "second_tool": 0.0, "team_id": 0.0}
    if calls and calls[0]["name"] == "find_employee" and str(calls[0]["args"].get("name", "")).strip() == task["employee"]:
        parts["find_employee"] = 1.0
    later = [c for c in calls[1:] if c["name"] == second]
    if parts["find_employee"] and later:
        parts["second_tool"] = 1.0
        parts["team_id"] = float(any(_as_int(c["args"].get("team_id")) == task["team_id"] for c in later))
    parts["answer"] = float(bool(re.search(rf"\b{re.escape(task['expected'])}\b", state.get("answer") or "")))
    reward = 0.1 * parts["call_format"] + 0.2 * parts["find_employee"] + 0.1 * parts["second_tool"] + 0.2 * parts["team_id"]
    return reward + 0.4 * parts["answer"], parts


def _call_format(reply: Any, task: dict[str, Any]) -> float:
    """Share of the expected first call's pieces in what the model wrote (a parsed call is written back as text)."""
    text = reply.content if isinstance(reply.content, str) else json.dumps(reply.content)
    text += "".join(
        f'<tool_call>\n{{"name": "{c["name"]}", "arguments": {json.dumps(c["args"])}}}\n</tool_call>' for c in reply.tool_calls
    )
    pieces = ["<tool_call>", '"name": "find_employee"', '"arguments": {', f'"name": "{task["employee"]}"', "</tool_call>"]
    return sum(piece in text for piece in pieces) / len(pieces)


def _as_int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
