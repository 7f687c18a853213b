"""Imported turns carry no sampler token ids: ``backend.train`` refuses them unless told to
retokenize (DESIGN §5.1), and then trains on them with the real SmolLM2-135M (CPU)."""

from __future__ import annotations

import asyncio

import pytest
from capture_fake_server import FakeOpenAIServer
from otlp_collector import OTLPCollector
from test_import_otlp import record_without_tracerl

import tracerl
from tracerl.integrations.importers import import_otlp

pytestmark = pytest.mark.real_model


def test_imported_turns_train_only_with_allow_retokenize(tmp_path, smol_path):
    with FakeOpenAIServer() as server, OTLPCollector() as collector:
        record_without_tracerl("openai", server, collector, ["capital of France", "capital of Spain"])
        imported = import_otlp(collector.dump(tmp_path / "traffic.jsonl"))
    assert all(t.metadata["retokenized"] and t.sampled_turns() for t in imported)
    group = tracerl.TrajectoryGroup(imported)
    group.trajectories[0].reward, group.trajectories[1].reward = 1.0, 0.0

    async def run() -> tuple[Exception, tracerl.TrainResult]:
        model = tracerl.TrainableModel("imported", "tests", "smollm2-135m", base_path=tmp_path / "runs")
        backend = tracerl.LocalBackend(inference=None)
        await model.register(backend)
        try:
            with pytest.raises(tracerl.TrajectoryError, match="allow_retokenize=True") as refused:
                await backend.train(model, [group], learning_rate=1e-4)
            result = await backend.train(model, [group], learning_rate=1e-4, allow_retokenize=True)
        finally:
            await backend.close()
        return refused.value, result

    refused, result = asyncio.run(run())
    assert "carries no token ids" in str(refused)
    assert result.step == 1 and result.metrics["num_groups_trainable"] == 1
    assert result.metrics["retokenized_turns"] == sum(len(t.sampled_turns()) for t in imported) > 0
    assert result.metrics["trained_tokens"] > 0
