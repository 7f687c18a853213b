"""Step metrics to Weights & Biases, checked in the files of a real offline W&B run."""

from __future__ import annotations

import pytest
from wandb_offline import history

import tracerl
from tracerl.integrations.wandb import log_to_wandb

pytest.importorskip("wandb")


def _group(rewards, task):
    return tracerl.TrajectoryGroup(
        [tracerl.Trajectory(messages_and_choices=[{"role": "user", "content": f"{task} {r}"}], reward=r) for r in rewards]
    )


async def test_every_logged_row_reaches_the_offline_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    model = tracerl.Model("wandb-agent", "wandb-project", base_path=tmp_path / "runs")
    logger = log_to_wandb(trajectories=True)
    try:
        await model.log([_group([0.0, 1.0], "a")], split="train", step=1, metrics={"loss": 0.5})
        await model.log([_group([1.0, 1.0], "b")], split="val", step=1)
        await model.log([_group([0.5, 1.0], "c")], split="train", step=2, metrics={"loss": 0.25})
    finally:
        logger.close()
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    rows = history(run_dir)
    written = model.history()  # history.jsonl
    assert [r["_step"] for r in rows] == [1, 2]  # one W&B step per training step (train and val merged)
    merged = {1: {**written[0], **written[1]}, 2: written[2]}
    for row in rows:
        expected = {k: v for k, v in merged[row["_step"]].items() if k not in ("step", "time")}
        metrics = {k: v for k, v in row.items() if "/trajectories" not in k and k != "_step"}
        assert metrics == pytest.approx(expected)
    assert rows[0]["train/trajectories/_type"] == "table-file" and rows[0]["train/trajectories/nrows"] == 2
    assert rows[0]["val/trajectories/nrows"] == 2 and rows[1]["train/trajectories/nrows"] == 2
    assert list((run_dir / "files" / "media" / "table").rglob("*.table.json"))


def test_without_wandb_installed_the_error_says_what_to_install(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(tracerl.ConfigError, match=r"tracerl\[wandb\]"):
        log_to_wandb()
