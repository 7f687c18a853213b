"""tracerl: train the LLM agents you already have with reinforcement learning.

``import tracerl`` stays light (no torch, transformers or vllm): the trainer and the
inference servers are imported only when a ``LocalBackend`` is created.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import (
    CheckpointError,
    ConfigError,
    InferenceServerError,
    InferenceTimeoutError,
    InfrastructureError,
    JudgeError,
    JudgeTimeoutError,
    McpServerError,
    McpTimeoutError,
    MismatchError,
    NonFiniteError,
    RemoteBackendError,
    RemoteConnectionError,
    RemoteTimeoutError,
    RolloutTimeoutError,
    RunLockedError,
    TeacherError,
    TeacherTimeoutError,
    TooManyExceptionsError,
    TracerlError,
    TrajectoryError,
)
from .gather import gather_trajectories, gather_trajectory_groups
from .model import Backend, Model, TrainableModel
from .redact import install_log_filter as _install_log_filter
from .retry import retry
from .train.dataset import iterate_dataset
from .types import (
    Choice,
    DatasetBatch,
    ExceptionRecord,
    History,
    MessageOrChoice,
    Messages,
    MessagesAndChoices,
    SamplingParams,
    Tools,
    TrainResult,
    Trajectory,
    TrajectoryGroup,
)

if TYPE_CHECKING:  # pragma: no cover
    from tracerl.integrations import rollout, trajectory, trajectory_group

    from .serve.remote_backend import RemoteBackend
    from .tinker.backend import TinkerBackend
    from .train.distill import CompletionsTeacher, add_teacher_advantages, served_teacher, with_worked_examples
    from .loops.pipeline import PipelineTrainer
    from .loops.retention import keep_recent_and_top
    from .train.local_backend import LocalBackend
    from .train.sft_config import SFTConfig, TrainSFTConfig, create_lr_schedule
    from .train.sft_data import filter_by_reward, load_sft_file

__version__ = "0.1.0"
_install_log_filter()  # tracerl's own log records are redacted too (tracerl.redact)

__all__ = [
    "Backend",
    "CheckpointError",
    "Choice",
    "CompletionsTeacher",
    "ConfigError",
    "DatasetBatch",
    "ExceptionRecord",
    "History",
    "InferenceServerError",
    "InferenceTimeoutError",
    "InfrastructureError",
    "JudgeError",
    "JudgeTimeoutError",
    "LocalBackend",
    "McpServerError",
    "McpTimeoutError",
    "MismatchError",
    "MessageOrChoice",
    "Messages",
    "MessagesAndChoices",
    "Model",
    "NonFiniteError",
    "PipelineTrainer",
    "RemoteBackend",
    "RemoteBackendError",
    "RemoteConnectionError",
    "RemoteTimeoutError",
    "RolloutTimeoutError",
    "RunLockedError",
    "SFTConfig",
    "SamplingParams",
    "TeacherError",
    "TeacherTimeoutError",
    "TinkerBackend",
    "TooManyExceptionsError",
    "Tools",
    "TracerlError",
    "TrainResult",
    "TrainSFTConfig",
    "TrainableModel",
    "Trajectory",
    "TrajectoryError",
    "TrajectoryGroup",
    "add_teacher_advantages",
    "create_lr_schedule",
    "filter_by_reward",
    "gather_trajectories",
    "gather_trajectory_groups",
    "iterate_dataset",
    "keep_recent_and_top",
    "load_sft_file",
    "retry",
    "rollout",
    "served_teacher",
    "trajectory",
    "trajectory_group",
    "with_worked_examples",
]

_LAZY = {
    "CompletionsTeacher": "tracerl.train.distill",
    "add_teacher_advantages": "tracerl.train.distill",
    "served_teacher": "tracerl.train.distill",
    "with_worked_examples": "tracerl.train.distill",
    "LocalBackend": "tracerl.train.local_backend",
    "PipelineTrainer": "tracerl.loops.pipeline",
    "keep_recent_and_top": "tracerl.loops.retention",
    "RemoteBackend": "tracerl.serve.remote_backend",
    "TinkerBackend": "tracerl.tinker.backend",
    "SFTConfig": "tracerl.train.sft_config",
    "TrainSFTConfig": "tracerl.train.sft_config",
    "create_lr_schedule": "tracerl.train.sft_config",
    "filter_by_reward": "tracerl.train.sft_data",
    "load_sft_file": "tracerl.train.sft_data",
    "rollout": "tracerl.integrations",
    "trajectory": "tracerl.integrations",
    "trajectory_group": "tracerl.integrations",
}


def __getattr__(name: str) -> Any:
    """Import heavy parts on first use so ``import tracerl`` never pulls in torch."""
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tracerl' has no attribute {name!r}")
