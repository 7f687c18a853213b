"""A RemoteBackend client killed between ``train`` and ``model.log`` recovers the step's history row.

History lives on the client (where ``model.log`` runs), checkpoints on the server: the server
commits each step with its ``step.json`` record, and ``RemoteBackend.register`` writes the rows
of server steps the client never logged.  A real ``tracerl serve`` app over HTTP around a real
``LocalBackend`` (no model is loaded: a planted checkpoint 0 and steps of equal rewards, which
``train`` commits by copying the adapter forward, as in the storage fault tests); the client is
SIGKILLed in a child process right after ``train`` returned.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import tracerl
from tracerl.net.http_server import BackgroundUvicorn
from tracerl.serve.server import create_app
from tracerl.serve.policy import ModelPolicy
from tracerl.runs.storage import RunDir

from storage_kill_child import NAME, PROJECT, plant_checkpoint_zero

CLIENT = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    import tracerl

    async def main(url, base_model, client_dir, kill):
        backend = tracerl.RemoteBackend(url)
        model = tracerl.TrainableModel(sys.argv[5], sys.argv[6], base_model, base_path=client_dir)
        await model.register(backend)
        for step in range(2):
            groups = [tracerl.TrajectoryGroup(
                [tracerl.Trajectory(messages_and_choices=[{"role": "user", "content": f"t{step}.{i}"}], reward=0.5) for i in range(2)]
            )]
            result = await backend.train(model, groups)
            if kill == "yes" and result.step == 2:
                os.kill(os.getpid(), signal.SIGKILL)  # train returned, model.log never ran
            await model.log(groups, split="train", metrics=result.metrics, step=result.step)
        await backend.close()

    asyncio.run(main(*sys.argv[1:5]))
    """
)


def _client(url: str, base_model: str, client_dir: Path, kill: bool) -> int:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    args = [sys.executable, "-c", CLIENT, url, base_model, str(client_dir), "yes" if kill else "no", NAME, PROJECT]
    return subprocess.run(args, env=env, timeout=120, capture_output=True, text=True).returncode


def test_a_client_killed_after_remote_train_recovers_the_row_from_the_servers_checkpoint(tmp_path):
    server_dir, client_dir = tmp_path / "server", tmp_path / "client"
    plant_checkpoint_zero(server_dir)
    backend = tracerl.LocalBackend(path=server_dir, inference=None)
    policy = ModelPolicy(models_dir=server_dir)
    http = BackgroundUvicorn(create_app(backend, policy=policy), name="tracerl-serve-recovery")
    url = f"http://127.0.0.1:{http.start()}"
    base_model = str(server_dir / "base-model")
    try:
        assert _client(url, base_model, client_dir, kill=True) == -9
        history = RunDir(client_dir, PROJECT, NAME).read_history()
        assert [row["step"] for row in history] == [1], "step 2 trained on the server, its row never written here"
        assert RunDir(server_dir, PROJECT, NAME).read_step_record(2) is not None

        assert _client(url, base_model, client_dir, kill=False) == 0  # the rerun registers again, then trains 3 and 4
        rows = RunDir(client_dir, PROJECT, NAME).read_history()
        assert [row["step"] for row in rows] == [1, 2, 3, 4], "every step's train row exactly once"
        recovered = [row for row in rows if row.get("recovered")]
        assert [row["step"] for row in recovered] == [2] and "train/step_seconds" in recovered[0]
    finally:
        http.stop()
