"""One exception root for tracerl.

Every error we raise derives from :class:`TracerlError`; where an error replaces a
standard one it also inherits that, so ``except ValueError`` in user code keeps working.
Foreign errors are translated at the boundary with ``raise ... from``.
"""

from __future__ import annotations


class TracerlError(Exception):
    """Root of every error raised by tracerl."""


class ConfigError(TracerlError, ValueError):
    """A setting, name or argument is invalid (bad model name, unknown base model...)."""


class TrajectoryError(TracerlError, ValueError):
    """A trajectory cannot be used as given (malformed messages, missing token ids...)."""


class NonFiniteError(TracerlError, FloatingPointError):
    """A training step met a NaN or infinite loss, gradient or adapter weight, so it was not taken.

    Raised by ``backend.train`` (unless ``on_non_finite="skip"``) with the step not advanced and
    the adapter and optimizer state as they were before the call.  ``sequences`` holds the
    indices of the training sequences whose tokens had a non-finite loss (when known);
    ``adapter_changed`` says the in-memory adapter was already updated and must be reloaded.
    """

    def __init__(self, message: str, *, sequences: tuple[int, ...] = (), adapter_changed: bool = False) -> None:
        super().__init__(message)
        self.sequences = tuple(sequences)
        self.adapter_changed = adapter_changed


class InsufficientMemoryError(TracerlError, MemoryError):
    """A GPU has too little free memory for the model about to be loaded onto it.

    Raised before loading (see ``tracerl.inference.devices``), with the numbers: ``free_bytes``,
    ``total_bytes`` and ``need_bytes``, and a message saying what to do."""

    def __init__(self, message: str, *, free_bytes: int, total_bytes: int, need_bytes: int) -> None:
        super().__init__(message)
        self.free_bytes = free_bytes
        self.total_bytes = total_bytes
        self.need_bytes = need_bytes


class CheckpointError(TracerlError, RuntimeError):
    """A checkpoint or the run directory is missing or inconsistent."""


class InfrastructureError(TracerlError, RuntimeError):
    """Something a rollout depends on failed: the inference server, an MCP server, a tool's connection.

    Such an attempt says nothing about the policy, so it must never become a trajectory to
    train on: raised inside a rollout, ``gather_trajectory_groups`` records it in
    ``group.exceptions`` (counted against ``max_exceptions``).  Capture raises it at the end
    of a rollout even when the agent swallowed the failure (see ``tracerl.rollout``).
    """


class InferenceServerError(InfrastructureError):
    """The inference server failed to start, died, dropped the connection, or answered 5xx."""


class NoHealthyReplicaError(InferenceServerError):
    """The router (``tracerl.cluster.Router``) has no healthy inference replica left for a request.

    An infrastructure failure (recorded in ``group.exceptions``, never trained on); served over
    HTTP as a 503 whose error type is this class's name.  ``replicas`` names each one and why."""

    def __init__(self, message: str, *, replicas: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.replicas = dict(replicas or {})


class InferenceTimeoutError(InferenceServerError, TimeoutError):
    """A model call did not answer in time (knob: ``Model(inference_timeout=...)``)."""


class TeacherError(InfrastructureError):
    """A distillation teacher could not score the student's tokens (unreachable, an error, or an
    answer that does not score exactly the sampled tokens): never a zero-KL trajectory."""


class TeacherTimeoutError(TeacherError, TimeoutError):
    """A distillation teacher did not answer in time (knob: ``CompletionsTeacher(timeout=...)``)."""


class McpServerError(InfrastructureError):
    """An MCP server could not be started, reached or listed, died, or dropped the connection."""


class McpTimeoutError(McpServerError, TimeoutError):
    """An MCP server did not answer in time (knobs: ``McpServerSpec(startup_timeout=..., request_timeout=...)``)."""


class RolloutWorkerError(InfrastructureError):
    """The worker a rollout ran on was lost (its process died, its node left the cluster, Ray could not
    place or return it): ``tracerl.cluster.RayRollouts``.  Says nothing about the policy: recorded in
    ``group.exceptions``, never trained on."""


class RolloutTimeoutError(TracerlError, TimeoutError):
    """A rollout ran past ``rollout_timeout`` and was cancelled (its MCP sessions and servers closed)."""


class JudgeError(TracerlError, RuntimeError):
    """A judge (e.g. RULER) answered with something that cannot be turned into scores."""


class JudgeTimeoutError(JudgeError, TimeoutError):
    """A judge (or the scenario generator) did not answer in time (knob: ``extra_litellm_params={"timeout": s}``)."""


class TooManyExceptionsError(TracerlError, RuntimeError):
    """More rollouts failed during a gather than ``max_exceptions`` allows."""


class RemoteBackendError(TracerlError, RuntimeError):
    """``tracerl serve`` answered with an error (``status`` and the server-side ``error_type``)."""

    def __init__(self, message: str, *, status: int | None = None, error_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type


class RemoteConnectionError(RemoteBackendError, ConnectionError):
    """``tracerl serve`` could not be reached, or the connection broke mid-request."""


class RemoteTimeoutError(RemoteBackendError, TimeoutError):
    """``tracerl serve`` did not answer in time (knobs: ``RemoteBackend(timeout=..., train_timeout=...)``)."""


class RunLockedError(CheckpointError):
    """Another live process trains this model (holds its run lock); ``pid`` and ``host`` name it.

    A :class:`CheckpointError` (the run directory is not ours to write), so ``tracerl serve``
    answers it as a 409 conflict."""

    def __init__(self, message: str, *, path: object = None, pid: int | None = None, host: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.pid = pid
        self.host = host


class MismatchError(TracerlError, RuntimeError):
    """The trainer's logprobs of the sampled tokens disagree with the sampler's beyond the step's
    ``max_mismatch_kl``: training would be off-policy without knowing it.  Nothing was applied."""

    def __init__(self, message: str, *, metrics: dict[str, float] | None = None) -> None:
        super().__init__(message)
        self.metrics = dict(metrics or {})
