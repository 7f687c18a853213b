"""Step metrics to Weights & Biases: every ``model.log`` row, as ART users expect.

``log_to_wandb()`` once, before the training loop; from then on each ``model.log(...)`` the
loop already calls (it appends a row to ``history.jsonl``) is also ``run.log(row, step=step)``
in the model's W&B run (project = the model's project, run name = the model's name, unless
a ``run`` is given), optionally with the logged trajectories as a table.  ``wandb`` is
imported on first use (``pip install tracerl[wandb]``); ``WANDB_MODE=offline`` works as usual.
A W&B failure is logged, never raised into training.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from typing import Any

from tracerl.errors import ConfigError

logger = logging.getLogger("tracerl.integrations")
__all__ = ["WandbLogger", "log_to_wandb"]


class WandbLogger:
    """The ``model.log`` hook: one W&B run per model (or the one given); :meth:`close` finishes them."""

    def __init__(self, run: Any = None, *, trajectories: bool = False, init_kwargs: dict[str, Any] | None = None) -> None:
        self.run, self.trajectories, self.init_kwargs = run, trajectories, dict(init_kwargs or {})
        self._runs: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()

    def __call__(self, model: Any, groups: list[Any], split: str, step: int, row: dict[str, Any]) -> None:
        run = self._run_for(model)
        data: dict[str, Any] = {k: v for k, v in row.items() if k not in ("step", "time") and _finite(v)}
        if self.trajectories and groups:
            data[f"{split}/trajectories"] = _table(groups)
        run.log(data, step=int(step))

    def _run_for(self, model: Any) -> Any:
        if self.run is not None:
            return self.run
        key = (str(model.project), str(model.name))
        with self._lock:
            if key not in self._runs:
                wandb = _wandb()
                options = {"project": model.project, "name": model.name, "reinit": "create_new", **self.init_kwargs}
                self._runs[key] = wandb.init(**options)
            return self._runs[key]

    def close(self) -> None:
        """Stop logging; finish the runs this logger started (a given ``run`` is the caller's)."""
        from tracerl.model import on_log

        if self in on_log:
            on_log.remove(self)
        with self._lock:
            runs, self._runs = list(self._runs.values()), {}
        for run in runs:
            run.finish()


def log_to_wandb(run: Any = None, *, trajectories: bool = False, **init_kwargs: Any) -> WandbLogger:
    """Send every ``model.log`` row to W&B from now on; returns the logger (``.close()`` to stop).

    ``run``: an existing ``wandb`` run to log into; else one run per model, started on its
    first ``log`` with ``wandb.init(project=model.project, name=model.name, **init_kwargs)``.
    ``trajectories=True`` also logs each step's trajectories as a ``{split}/trajectories``
    table (group, reward, messages).
    """
    _wandb()  # fail now, with the install hint, rather than at the first step
    from tracerl.model import on_log

    logger_ = WandbLogger(run, trajectories=trajectories, init_kwargs=init_kwargs)
    on_log.append(logger_)
    return logger_


def _table(groups: list[Any]) -> Any:
    wandb = _wandb()
    rows = [
        [gi, t.reward, json.dumps(t.messages(), default=str, ensure_ascii=False)]
        for gi, group in enumerate(groups)
        for t in group.trajectories
    ]
    return wandb.Table(columns=["group", "reward", "messages"], data=rows)


def _wandb() -> Any:
    try:
        import wandb
    except ImportError as error:
        raise ConfigError("log_to_wandb needs the wandb package: pip install 'tracerl[wandb]'") from error
    return wandb


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
