"""ART's own published rollout code runs on tracerl with only its import changed (issue 31, item 3).

The code is not copied into this repository (its licence is ART's): the test fetches the
``openpipe-art`` source distribution from PyPI at a pinned version, takes the rollout and
evaluation functions of ``art/pipeline_trainer/yes_no_maybe_pipeline.py`` (ART's minimal
example) character for character, replaces ``import art`` with ``import tracerl as art`` and
runs them against the real SmolLM2-135M served by tracerl's transformers server: ``n=32``
choices in one request, the SDK's raw ``Choice`` objects in ``messages_and_choices``,
``model.openai_client()``, ``model.get_inference_name()`` and ``get_inference_name(step)``.
Then one GRPO step trains on what they returned.  Skipped, with the reason, only when PyPI is
unreachable.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tarfile
from types import ModuleType

import pytest

import tracerl

ART = "openpipe-art==0.5.18"
EXAMPLE = "openpipe_art-0.5.18/src/art/pipeline_trainer/yes_no_maybe_pipeline.py"
TAKEN = ("ROLLOUTS_PER_SCENARIO", "MAX_TOKENS", "build_scenarios", "reward_for_answer", "eval_fn", "rollout_fn")
"""What the test runs of ART's example: its constants, scenarios, reward, evaluation and rollout."""
HEADER = "from __future__ import annotations\n\nimport re\nfrom itertools import permutations\n\nimport tracerl as art\n"
"""The example's imports that ``TAKEN`` uses, ``import art`` changed to ``import tracerl as art``."""


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> tuple[str, list[str]]:
    """ART's example file as published, and the parts of it the test runs (``TAKEN``, verbatim)."""
    folder = tmp_path_factory.mktemp("openpipe-art")
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", "--dest", str(folder), ART]  # fmt: skip
    try:
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as error:
        pytest.skip(f"PyPI unreachable: pip download {ART} failed ({getattr(error, 'stderr', '') or error})")
    [sdist] = folder.glob("openpipe_art-*.tar.gz")
    with tarfile.open(sdist) as archive:
        source = archive.extractfile(EXAMPLE).read().decode()  # type: ignore[union-attr]
    tree = ast.parse(source)
    parts = {}
    for node in tree.body:
        names = [node.name] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else [
            t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]  # fmt: skip
        for name in names:
            parts[name] = ast.get_source_segment(source, node)
    assert "import art\n" in source and set(TAKEN) <= parts.keys(), "ART's published example changed shape"
    return source, [parts[name] for name in TAKEN]


def _load(parts: list[str]) -> ModuleType:
    """The module the test runs: ``HEADER``, then ART's parts as published."""
    module = ModuleType("art_yes_no_maybe")
    exec(compile(HEADER + "\n\n" + "\n\n\n".join(parts), EXAMPLE, "exec"), module.__dict__)  # noqa: S102 - ART's code, from PyPI
    return module


def test_the_parts_are_arts_as_published(published):
    source, parts = published
    assert all(part in source for part in parts)
    assert parts[-1].startswith("async def rollout_fn(model, scenario, _config) -> art.TrajectoryGroup:")
    assert "art.Trajectory(\n                messages_and_choices=[*messages, choice]," in parts[-1]


@pytest.mark.real_model
async def test_arts_published_rollout_samples_trains_and_evaluates(published, tmp_path):
    example = _load(published[1])
    assert example.art is tracerl
    scenarios = example.build_scenarios()
    backend = tracerl.LocalBackend(tmp_path, inference="transformers")
    model = tracerl.TrainableModel(name="yes-no-maybe", project="art-published", base_model="smollm2-135m")
    try:
        await model.register(backend)
        groups = [await example.rollout_fn(model, scenario, None) for scenario in scenarios[:2]]
        assert [len(g.trajectories) for g in groups] == [example.ROLLOUTS_PER_SCENARIO] * 2
        for group in groups:
            for trajectory in group.trajectories:
                [choice] = trajectory.sampled_turns()  # the SDK's Choice, converted with its served tokens
                assert choice.token_ids and len(choice.logprobs) == len(choice.token_ids) <= example.MAX_TOKENS
                assert trajectory.reward == example.reward_for_answer(choice.message["content"] or "")
        result = await backend.train(model, groups, learning_rate=5e-5)
        assert result.step == 1 and result.metrics["num_groups"] == 2
        varied = sum(len({t.reward for t in g.trajectories}) > 1 for g in groups)
        assert result.metrics["num_groups_trainable"] == varied
        if varied:
            assert result.metrics["trained_tokens"] > 0

        evaluated = await example.eval_fn(model, result.step, None, scenarios=scenarios[:4])  # asks for "yes-no-maybe@1"
        assert len(evaluated) == 4 and all(t.sampled_turns()[0].token_ids for t in evaluated)
    finally:
        await backend.close()
