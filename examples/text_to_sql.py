"""Text-to-SQL on a SQLite database the example builds: SFT from a generated dataset, then GRPO
with an execution-match reward (ART's gallery trains SQL agents the same way).

    python examples/text_to_sql.py --steps 13 --seed 0

The database is one table, ``employees(name, department, city, salary, age)``, 30 rows made from a
fixed seed.  A question comes from one of :data:`TEMPLATES` with its values filled in (a department,
a city, an age or a salary), and its gold query from the same template.  The policy sees the schema
and the question and answers with one query; the reward is checked in code (:func:`score`): 1.0
when its result equals the gold query's (as a multiset of rows; in order when the gold query
orders them), 0.0 when it runs but differs, -0.5 when it does not run.  Queries run on a read-only
connection with a time limit.

Step 1 is SFT (``backend.train_sft``) on ``--sft-examples`` question/query pairs from the training
split; GRPO makes the steps after it.  Held-out: 64 distinct questions (fixed seeds) never trained on in SFT
or RL, answered greedily; ``val/correct`` is execution accuracy.
"""

from __future__ import annotations

import argparse
import random
import re
import sqlite3
import time
from collections import Counter

import gallery  # this folder's shared game loop
import openai
import tracerl

DEPARTMENTS = ["Sales", "Engineering", "Marketing", "Finance", "Support"]
CITIES = ["Paris", "Berlin", "Madrid", "Rome", "Oslo"]
NAMES = [
    "Ada", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gina", "Hugo", "Ines", "Jon", "Kira", "Leo", "Mia", "Nils", "Olga",
    "Paul", "Quinn", "Rosa", "Sam", "Tara", "Ugo", "Vera", "Walt", "Xena", "Yann", "Zoe", "Amir", "Bea", "Cyril", "Dora",
]  # fmt: skip
SCHEMA = "CREATE TABLE employees (name TEXT, department TEXT, city TEXT, salary INTEGER, age INTEGER);"
SYSTEM = (
    f"You write SQLite queries for this database:\n{SCHEMA}\n"
    f"Departments: {', '.join(DEPARTMENTS)}. Cities: {', '.join(CITIES)}.\n"
    "Answer each question with one SQL query and nothing else."
)
TEMPLATES: list[tuple[str, str]] = [
    ("How many employees work in {dept}?", "SELECT COUNT(*) FROM employees WHERE department = '{dept}'"),
    ("How many employees are based in {city}?", "SELECT COUNT(*) FROM employees WHERE city = '{city}'"),
    ("List the names of the employees in {city}.", "SELECT name FROM employees WHERE city = '{city}'"),
    ("List the names of the employees in {dept}.", "SELECT name FROM employees WHERE department = '{dept}'"),
    ("What is the highest salary in {dept}?", "SELECT MAX(salary) FROM employees WHERE department = '{dept}'"),
    ("What is the average age of the employees in {city}?", "SELECT AVG(age) FROM employees WHERE city = '{city}'"),
    ("Which employees are older than {age}?", "SELECT name FROM employees WHERE age > {age}"),
    ("Which employees earn more than {salary}?", "SELECT name FROM employees WHERE salary > {salary}"),
    ("Who earns the most in {city}?", "SELECT name FROM employees WHERE city = '{city}' ORDER BY salary DESC LIMIT 1"),
    ("How many employees of {dept} work in {city}?",
     "SELECT COUNT(*) FROM employees WHERE department = '{dept}' AND city = '{city}'"),
    ("What is the lowest salary in {city}?", "SELECT MIN(salary) FROM employees WHERE city = '{city}'"),
    ("What is the average salary in {dept}?", "SELECT AVG(salary) FROM employees WHERE department = '{dept}'"),
    ("How many employees are older than {age}?", "SELECT COUNT(*) FROM employees WHERE age > {age}"),
    ("How many employees in {city} are older than {age}?", "SELECT COUNT(*) FROM employees WHERE city = '{city}' AND age > {age}"),
    ("Which employees of {dept} earn more than {salary}?",
     "SELECT name FROM employees WHERE department = '{dept}' AND salary > {salary}"),
    ("Which employees of {dept} are younger than {age}?", "SELECT name FROM employees WHERE department = '{dept}' AND age < {age}"),
    ("Who is the oldest employee in {dept}?", "SELECT name FROM employees WHERE department = '{dept}' ORDER BY age DESC LIMIT 1"),
]  # fmt: skip
QUERY_SECONDS = 1.0


def build_database() -> sqlite3.Connection:
    """The example's database in memory, the same rows every time, then read-only."""
    rng = random.Random(2024)
    db = sqlite3.connect(":memory:")
    db.execute(SCHEMA)
    rows = [(n, rng.choice(DEPARTMENTS), rng.choice(CITIES), rng.randrange(30, 121) * 1000, rng.randrange(22, 65)) for n in NAMES]
    db.executemany("INSERT INTO employees VALUES (?, ?, ?, ?, ?)", rows)
    db.commit()
    db.execute("PRAGMA query_only = ON")
    return db


DB = build_database()


def question(item: int) -> tuple[str, str]:
    """Item ``item``'s question and gold query."""
    rng = random.Random(item)
    asked, gold = rng.choice(TEMPLATES)
    values = {"dept": rng.choice(DEPARTMENTS), "city": rng.choice(CITIES), "age": rng.randrange(25, 61),
              "salary": rng.randrange(40, 111, 5) * 1000}  # fmt: skip
    return asked.format(**values), gold.format(**values)


def held_out_items(n: int = 64) -> list[int]:
    """The first ``n`` items from 10,000 on whose questions differ (the held-out split)."""
    items: dict[str, int] = {}
    item = 10_000
    while len(items) < n:
        items.setdefault(question(item)[0], item)
        item += 1
    return list(items.values())


HELD_OUT = held_out_items()
HELD_OUT_QUESTIONS = {question(i)[0] for i in HELD_OUT}


def training_items(seed: int, n: int) -> list[int]:
    """``n`` items whose questions are none of the held-out ones."""
    return [item for item in gallery.items_outside(seed, 2 * n) if question(item)[0] not in HELD_OUT_QUESTIONS][:n]


def run_query(sql: str) -> list[tuple] | None:
    """The rows of ``sql`` on the read-only database, or None when it fails or runs past the time limit."""
    deadline = time.monotonic() + QUERY_SECONDS
    DB.set_progress_handler(lambda: int(time.monotonic() > deadline), 10_000)
    try:
        return DB.execute(sql).fetchall()
    except (sqlite3.Error, sqlite3.Warning, ValueError):  # Warning: more than one statement
        return None
    finally:
        DB.set_progress_handler(None, 0)


def extract_sql(text: str) -> str:
    """The query in a reply: a fenced block's body if there is one, up to the first semicolon."""
    fenced = re.search(r"```(?:sql)?\s*(.*?)(?:```|$)", text, re.DOTALL | re.IGNORECASE)
    return (fenced.group(1) if fenced else text).split(";")[0].strip()


def score(reply: str, gold: str) -> str:
    """``correct``, ``wrong`` (it runs, the rows differ) or ``error`` (it does not run)."""
    got, want = run_query(extract_sql(reply)), run_query(gold)
    if got is None:
        return "error"
    same = got == want if "ORDER BY" in gold else Counter(got) == Counter(want)
    return "correct" if same else "wrong"


OUTCOME_REWARD = {"correct": 1.0, "wrong": 0.0, "error": -0.5}


@tracerl.retry(max_attempts=2, exceptions=(openai.APITimeoutError,))
async def play(model: tracerl.TrainableModel, item: int, *, temperature: float, seed: int | None) -> tracerl.Trajectory:
    """One question answered with one query; the metrics say how it scored."""
    asked, gold = question(item)
    trajectory, reply = await gallery.answer(model, SYSTEM, asked, item, temperature=temperature, seed=seed, max_tokens=48)
    outcome = score(reply, gold)
    trajectory.reward = OUTCOME_REWARD[outcome]
    trajectory.metrics.update({name: float(name == outcome) for name in OUTCOME_REWARD})
    trajectory.metadata.update(question=asked, gold=gold, sql=extract_sql(reply))
    return trajectory


async def main(args: argparse.Namespace) -> tracerl.TrainableModel:
    pairs = gallery.sft_warmup(args, SYSTEM, question, "question/query pairs", items=training_items)
    return await gallery.train(args, "texttosql", play, ("correct", "wrong", "error"), "Text-to-SQL: SFT, then GRPO",
                               warmup=pairs, items=training_items, held_out=HELD_OUT[: args.val_games])  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return gallery.parser(__doc__, steps=13, sft_examples=64).parse_args(argv)


if __name__ == "__main__":
    gallery.run(main, parse_args())
