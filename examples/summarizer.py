"""A summarizer: SFT warm-up, then GRPO with a reward checked in code (ART's gallery has a summarizer
trained the same way), to see what RL adds over SFT alone.

    python examples/summarizer.py --steps 13 --seed 0

A document is a short generated news item: three sentences of facts (who, where, how many) mixed
with three sentences of filler.  A summary passes (:func:`check`) when it names the person, the
city and the number, in at most :data:`MAX_WORDS` words.  The reward is the share of the three
facts present, or -0.5 for a summary over the bound.

Step 1 is SFT on ``--sft-examples`` documents with a one-sentence reference summary; GRPO makes
the steps after it.  Held-out: 64 documents (fixed seeds) summarized greedily; ``val/passed`` is
the share of summaries that pass, ``val/facts`` the share of facts present.
"""

from __future__ import annotations

import argparse
import random
import re

import gallery  # this folder's shared game loop
import openai
import tracerl

MAX_WORDS = 20
PEOPLE = ["Maria Lopez", "Tom Becker", "Aiko Tanaka", "Omar Haddad", "Lena Novak", "Raj Patel", "Ines Costa", "Jon Berg"]
CITIES = ["Lisbon", "Tampere", "Porto", "Leeds", "Graz", "Bergen", "Lyon", "Gdansk", "Malmo", "Bilbao"]
WHAT = [
    ("opened a bakery", "the bakery employs {n} people", "opened a bakery with {n} staff"),
    ("founded a cycling club", "the club already counts {n} members", "founded a cycling club of {n} members"),
    ("built a community garden", "it has {n} vegetable beds", "built a community garden with {n} beds"),
    ("started a night school", "{n} students enrolled in the first week", "started a night school with {n} students"),
    ("restored an old cinema", "the cinema seats {n} people", "restored a {n}-seat cinema"),
]  # fmt: skip
FILLER = [
    "The weather that week was mild for the season.", "Local newspapers had covered similar projects before.",
    "Several neighbours said they had waited years for something like it.", "The mayor's office did not comment.",
    "Rents in the area have risen steadily.", "A small festival took place nearby on the same weekend.",
    "Public transport to the district was improved last year.", "Volunteers helped with the preparations.",
]  # fmt: skip
SYSTEM = f"Summarize the document in one sentence of at most {MAX_WORDS} words. Keep who, where and how many."


def document(item: int) -> tuple[str, str, dict[str, str]]:
    """Item ``item``'s document, a reference summary (SFT's answer) and its facts (person, city, number)."""
    rng = random.Random(item)
    person, city, n = rng.choice(PEOPLE), rng.choice(CITIES), str(rng.randrange(12, 480))
    did, detail, summary = rng.choice(WHAT)
    facts = [f"In {city}, {person} {did}.", f"According to the organisers, {detail.format(n=n)}.",
             f"{person.split()[0]} said the project took two years to prepare."]  # fmt: skip
    sentences = facts + rng.sample(FILLER, 3)
    rng.shuffle(sentences)
    return " ".join(sentences), f"{person} {summary.format(n=n)} in {city}.", {"person": person, "city": city, "number": n}


def check(summary: str, facts: dict[str, str]) -> tuple[int, bool]:
    """(facts present, within the word bound); a person counts by their surname."""
    present = sum(
        re.search(rf"\b{re.escape(value.split()[-1] if key == 'person' else value)}\b", summary) is not None
        for key, value in facts.items()
    )
    return present, len(summary.split()) <= MAX_WORDS


@tracerl.retry(max_attempts=2, exceptions=(openai.APITimeoutError,))
async def play(model: tracerl.TrainableModel, item: int, *, temperature: float, seed: int | None) -> tracerl.Trajectory:
    """One document, one summary; the metrics say how it scored."""
    text, _, facts = document(item)
    trajectory, summary = await gallery.answer(model, SYSTEM, text, item, temperature=temperature, seed=seed, max_tokens=48)
    present, short = check(summary, facts)
    trajectory.reward = present / len(facts) if short else -0.5
    trajectory.metrics.update(passed=float(short and present == len(facts)), facts=present / len(facts),
                              too_long=float(not short), words=float(len(summary.split())))  # fmt: skip
    return trajectory


async def main(args: argparse.Namespace) -> tracerl.TrainableModel:
    sft = gallery.sft_warmup(args, SYSTEM, lambda item: document(item)[:2], "reference summaries")
    return await gallery.train(args, "summarizer", play, ("passed", "facts", "too_long"), "Summarizer: SFT, then GRPO", warmup=sft)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return gallery.parser(__doc__, steps=13, sft_examples=32).parse_args(argv)


if __name__ == "__main__":
    gallery.run(main, parse_args())
