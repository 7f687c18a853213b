"""The run directory's on-disk format carries a version; runs written before it still load.

The files below are what tracerl wrote on 2026-12-04 (commit 57635ce, before formats were
numbered): ``model.json`` without ``"format"``, a history row, committed checkpoints with
their ``step.json``, and stored trajectories.  They are written here byte for byte as that
code wrote them, so this test fails if a change stops reading them.
"""

from __future__ import annotations

import asyncio
import json

import pytest

import tracerl
from tracerl.runs.storage import RUN_FORMAT, RunDir

BEFORE_FORMATS = {
    "model.json": json.dumps(
        {
            "name": "agent",
            "project": "calc",
            "base_model": "smollm2-135m",
            "resolved_base_model": "/root/.cache/tracerl/models/smollm2-135m",
            "lora_config": {"r": 8, "lora_alpha": 16},
        },
        indent=2,
    ),
    "history.jsonl": '{"step": 1, "time": 1764800000.0, "train/reward": 0.25, "train/loss": 0.01}\n'
    '{"step": 1, "time": 1764800001.0, "val/reward": 0.5}\n',
    "checkpoints/0000/adapter_config.json": '{"r": 8}',
    "checkpoints/0001/adapter_config.json": '{"r": 8}',
    "checkpoints/0001/step.json": '{"step": 1, "split": "train", "time": 1764800000.0, "metrics": {"train/reward": 0.25}}',
    "trajectories/val/0001.jsonl": '{"group": 0, "messages_and_choices": [{"role": "user", "content": "2+2?"}], "tools": null, '
    '"additional_histories": [], "reward": 0.5, "metrics": {}, "metadata": {}, "logs": [], "trace_id": null, "id": "f7f44eac0849"}\n',
}


def write_run(tmp_path, files=BEFORE_FORMATS):
    root = tmp_path / "calc" / "models" / "agent"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return RunDir(tmp_path, "calc", "agent")


def test_a_run_written_before_formats_still_loads(tmp_path):
    run = write_run(tmp_path)
    assert run.read_model_info()["base_model"] == "smollm2-135m"
    assert run.repair() == []  # nothing in it looks interrupted
    assert run.checkpoint_steps() == [0, 1] and run.read_step_record(1)["metrics"] == {"train/reward": 0.25}
    model = tracerl.TrainableModel("agent", "calc", "smollm2-135m", base_path=tmp_path)
    assert [row.get("val/reward") for row in model.history()] == [None, 0.5]
    assert asyncio.run(model.get_step()) == 1
    (row,) = [json.loads(line) for line in run.trajectories_path("val", 1).read_text().splitlines()]
    assert row.pop("group") == 0 and tracerl.Trajectory.model_validate(row).reward == 0.5


def test_model_json_now_names_its_format(tmp_path):
    run = write_run(tmp_path)
    info = run.read_model_info()
    run.write_model_info(info)
    assert json.loads(run.model_info_path.read_text()) == {**info, "format": RUN_FORMAT}
    assert run.read_model_info()["format"] == RUN_FORMAT


def test_a_run_of_a_newer_format_is_refused_before_anything_touches_it(tmp_path):
    newer = {**json.loads(BEFORE_FORMATS["model.json"]), "format": RUN_FORMAT + 1}
    run = write_run(tmp_path, {**BEFORE_FORMATS, "model.json": json.dumps(newer)})
    with pytest.raises(tracerl.ConfigError, match=f"newer tracerl \\(run format {RUN_FORMAT + 1}\\).*upgrade tracerl"):
        run.read_model_info()
    half_written = run.checkpoints / ".tmp-0002-x"
    half_written.mkdir()
    model = tracerl.TrainableModel("agent", "calc", "smollm2-135m", base_path=tmp_path)
    with pytest.raises(tracerl.ConfigError, match="newer tracerl"):
        asyncio.run(model.register(tracerl.LocalBackend(tmp_path, inference=None)))
    assert half_written.exists()  # repair did not run on a run it cannot read


@pytest.mark.parametrize("bad", ["2", 0, True, None])
def test_a_malformed_format_is_named(tmp_path, bad):
    info = {**json.loads(BEFORE_FORMATS["model.json"]), "format": bad}
    run = write_run(tmp_path, {**BEFORE_FORMATS, "model.json": json.dumps(info)})
    with pytest.raises(tracerl.ConfigError, match="run format"):
        run.read_model_info()
