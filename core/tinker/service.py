"""The Tinker service behind ``tracerl serve``: sessions, training runs, sampling sessions, futures.

Every training client is a LoRA of one shared :class:`~tracerl.tinker.lora_pool.LoRAPool`; its
operations run one at a time on one compute thread, each run's strictly in the ``seq_id``
order the SDK numbers them (a retried request gets its first answer, never a second run).
Weights saved for sampling are served by one multi-LoRA sampler
(:mod:`tracerl.tinker.samplers`: tracerl's transformers engine in this process, or a vLLM server),
where sampling runs beside training; the adapters it holds are capped per tenant and in all, the least recently used
unloaded first and loaded again on demand (:mod:`tracerl.tinker.sampler_adapters`).  Sampling
requests pass a fair admission of their own (:class:`~tracerl.tinker.fair_queue.FairGate`).
Results are futures the SDK polls (:meth:`TinkerService.wait`).

Every table is bounded per tenant (:class:`Limits`): results, sessions and sampling sessions
are pruned once answered (after a grace period: the SDK retries polls) or expired, and a full
table answers 429 with ``Retry-After``, so no tenant can evict another's pending work.
Unnamed (ephemeral) saves for sampling are dropped — unloaded and their folder deleted — when
the same run's next unnamed save supersedes them or their sampling session ends.

Checkpoints live on disk under ``root/<training run>/{weights,sampler_weights}/<name>`` in
peft's layout, each written whole or not at all (:func:`tracerl.runs.durable.atomic_dir`);
their ``tinker://`` paths name them.  ``run.json`` beside them records the run's tenant and
settings, so a restarted server (after a SIGKILL too) resumes every run from its newest
saved state: what was saved is never lost, and the SDK's next request continues the run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import hmac
import json
import logging
import math
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..base_models import EMBEDDED_ALIASES, resolve_base_model
from ..errors import ConfigError, NonFiniteError, TrajectoryError
from ..runs.durable import atomic_dir, atomic_write_text, remove_dir, repair_dir
from .fair_queue import FairGate, FairQueue, QueueFullError
from .lora_pool import AdapterSpec, LoRAPool
from .sampler_adapters import SamplerAdapters
from .samplers import SAMPLERS, SampleRequest, Sampler, make_sampler
from .usage import Usage, dir_bytes

log = logging.getLogger("tracerl.tinker")

EMBEDDED_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
EPHEMERAL_MARK = "tinker_ephemeral"
"""A file in the folder of an unnamed save for sampling (deleted when it is dropped, and at a restart)."""
SWEEP_S = 30.0
"""How often expired results, sessions and sampling sessions of idle tenants are pruned."""


@dataclass(frozen=True)
class Limits:
    """Every bound of the service, with its default; ``TRACERL_TINKER_<NAME>`` (upper case) sets one for
    ``tracerl serve`` (:meth:`from_env`).  The table in ``docs/serverless.md`` explains each."""

    max_sampler_adapters: int = 16
    """Adapters loaded in the sampler at once, all tenants together (least recently used unloaded first)."""
    max_sampler_adapters_per_tenant: int = 4
    """Adapters of one tenant loaded in the sampler at once."""
    max_results_per_tenant: int = 1024
    """Futures a tenant holds: pending, and finished ones not yet pruned (more: 429)."""
    result_grace_s: float = 120.0
    """An answered future stays pollable this long (the SDK retries a poll whose answer it lost)."""
    result_ttl_s: float = 3600.0
    """A finished future nobody polled is forgotten after this long."""
    max_sessions_per_tenant: int = 64
    """Open sessions (``ServiceClient``s) of a tenant (more: 429)."""
    session_idle_s: float = 1800.0
    """A session without a heartbeat this long has ended (the SDK sends one every 10 s)."""
    max_sampling_sessions_per_tenant: int = 256
    """Sampling sessions (sampling clients) of a tenant (more: 429)."""
    sampling_session_idle_s: float = 3600.0
    """A sampling session not sampled from this long has ended."""
    max_num_samples: int = 32
    """``num_samples`` of one sampling request at most (more: 400)."""
    max_prompt_tokens: int = 8192
    """Prompt tokens of one sampling or ``compute_logprobs`` request at most (more: 400)."""
    max_sample_tokens: int = 4096
    """``max_tokens`` of one sampling request at most (more: 400; unset: this, or what the context leaves)."""
    sample_slots: int = 8
    """Sampling requests in the sampler at once, all tenants together; the others wait their tenant's turn."""
    sample_batch_rows: int = 64
    """Rows (samples) the sampler decodes in one forward, every tenant's together: at least ``sample_slots`` requests'
    ``num_samples`` should fit, or the admitted requests decode a few at a time."""
    sample_share_active_s: float = 60.0
    """While several tenants have sampled within this many seconds, each holds at most ``sample_slots // tenants``
    slots (at least one); a tenant alone may hold them all."""
    max_samples_pending_per_tenant: int = 64
    """A tenant's sampling requests running or waiting (more: 429; the SDK waits and resubmits)."""
    max_disk_bytes_per_tenant: int = 20 * 2**30
    """Bytes of a tenant's checkpoints on disk (saved states and weights saved for sampling): a save that
    would take them above this answers 429 (delete checkpoints, then the SDK's retry goes through)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Limits:
        """The defaults, with each ``TRACERL_TINKER_<NAME>`` set in ``environ`` (``os.environ``) instead."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for spec in dataclasses.fields(cls):
            raw = environ.get(f"TRACERL_TINKER_{spec.name.upper()}")
            if raw is not None:
                try:
                    values[spec.name] = int(raw) if spec.type == "int" else float(raw)
                except ValueError as error:
                    raise ConfigError(f"TRACERL_TINKER_{spec.name.upper()} must be a number, got {raw!r}") from error
        return cls(**values)

    def __post_init__(self) -> None:
        for spec in dataclasses.fields(self):
            value = getattr(self, spec.name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"the Tinker limit {spec.name} must be a number > 0, got {value!r}")
        if self.max_sampler_adapters_per_tenant > self.max_sampler_adapters:
            raise ConfigError("max_sampler_adapters_per_tenant cannot be above max_sampler_adapters")


class TableFull(QueueFullError):
    """One of a tenant's tables (results, sessions, sampling sessions) is full (answered 429 with ``Retry-After``)."""


class DiskFull(QueueFullError):
    """A save would take the tenant's checkpoints above ``max_disk_bytes_per_tenant`` (answered 429 with ``Retry-After``)."""


USAGE_FILE = "usage.json"
"""Each tenant's usage totals, in the service's root (beside the runs' folders)."""
USER_ERRORS = (ConfigError, TrajectoryError, NonFiniteError, ValueError, TypeError, KeyError)
"""Failures the caller can fix: reported as category ``user``; anything else is ``server`` (and logged)."""
KINDS = {"weights": "training", "sampler_weights": "sampler"}
DEFAULT_TENANT = "default"


class NotFound(LookupError):
    """An unknown session, training run, sampling session, checkpoint or request id (answered 404)."""


class Gone(Exception):
    """A finished session (answered 410: the SDK stops its heartbeat)."""


class Forbidden(PermissionError):
    """A quota reached: training runs, LoRA rank (answered 403).  Another tenant's objects are
    :class:`NotFound`, answered exactly as an unknown one (their names are never confirmed)."""


@dataclass
class Result:
    """One future: a JSON dict or protobuf bytes once done, or ``(message, category)`` on failure."""

    request_id: str
    tenant: str
    done: asyncio.Event = field(default_factory=asyncio.Event)
    payload: dict[str, Any] | bytes | None = None
    error: tuple[str, str] | None = None
    finished: float | None = None  # time.monotonic() when done
    answered: float | None = None  # when a poll first got it
    keys: list[tuple[str, ...]] = field(default_factory=list)  # its entries in TinkerService.created


@dataclass
class TrainingRun:
    model_id: str
    tenant: str
    session_id: str
    base_model: str
    spec: AdapterSpec
    user_metadata: dict[str, Any] | None = None
    last_request_time: str = ""
    next_seq: int = 1  # creation is seq 0; the client's requests count from 1 (0: resumed, the next one sets it)
    by_seq: dict[int, Result] = field(default_factory=dict)
    waiting: dict[int, Callable[[], Any]] = field(default_factory=dict)
    ephemeral: str | None = None  # the path of its newest unnamed save for sampling


@dataclass
class SamplingSession:
    tenant: str
    base_model: str
    model_path: str | None  # tinker://... (None: the base model)
    session_id: str = ""
    used: float = field(default_factory=time.monotonic)
    running: int = 0  # its sampling requests not finished


def now_iso() -> str:
    return datetime.now(UTC).isoformat()


def parse_path(path: str) -> tuple[str, str, str]:
    """``tinker://<run>/<weights|sampler_weights>/<name>`` → its three parts (``ConfigError`` otherwise:
    a name that is not one folder, ``..`` and separators included, is no checkpoint path)."""
    parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in KINDS or not all(parts) or not ok_name(parts[2]) or parts[0] in {".", ".."}:
        raise ConfigError(f"{path!r} is not a checkpoint path: tinker://<training run>/weights|sampler_weights/<name>")
    return parts[0], parts[1], parts[2]


def ok_name(name: str) -> bool:
    return bool(name) and not name.startswith(".") and not any(c in name for c in "/\\:\0")


def check_name(name: str) -> str:
    if not ok_name(name):
        raise ConfigError(f"checkpoint name {name!r} must be non-empty, not start with '.', without '/', '\\' or ':'")
    return name


class TinkerService:
    """One base model's training runs and samplers, for one or many tenants (see the module docstring).

    ``keys`` maps each API key to its tenant; ``None``: one tenant, keyed by ``tracerl serve``'s
    token.  A tenant sees only its own sessions, runs, samplers, checkpoints and results
    (another's is :class:`NotFound`, as an unknown one).  Quotas per tenant: ``max_models`` training
    runs, ``max_lora_rank``, ``max_queued`` operations waiting on the compute thread, and
    ``limits`` (:class:`Limits`: the sampler's adapters, tables, sampling requests).
    """

    def __init__(
        self, root: str | Path, *, base_model: str = "smollm2-135m", keys: Mapping[str, str] | None = None,
        max_models: int = 4, max_lora_rank: int = 64, max_queued: int = 256, longpoll_s: float = 35.0, dtype: str = "auto",
        limits: Limits | None = None, sampler: str = "transformers", sampler_options: Mapping[str, Any] | None = None,
    ) -> None:  # fmt: skip
        """``dtype``: the base weights' format in the adapter pool and the sampler (``"auto"``: bf16 on a
        GPU, fp32 on a CPU; :data:`tracerl.inference.devices.DTYPES`).  ``limits``: None reads
        :meth:`Limits.from_env` (the defaults, each ``TRACERL_TINKER_<NAME>`` set overriding one).
        ``sampler``: ``"transformers"`` or ``"vllm"`` (:mod:`tracerl.tinker.samplers`); ``sampler_options``:
        more :class:`~tracerl.inference.vllm_server.VLLMServer` settings for a vLLM sampler."""
        from ..inference.devices import DTYPES

        if dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(map(repr, DTYPES))}, got {dtype!r}")
        if sampler not in SAMPLERS:
            raise ConfigError(f"sampler must be one of {', '.join(map(repr, SAMPLERS))}, got {sampler!r}")
        self.sampler_kind, self.sampler_options = sampler, dict(sampler_options or {})
        self.dtype = None if dtype == "auto" else dtype
        self.root = Path(root)
        self.model_path = resolve_base_model(base_model)
        self.model_name = EMBEDDED_NAME if base_model.lower() in EMBEDDED_ALIASES else base_model
        self.keys = dict(keys) if keys is not None else None
        self.max_models, self.max_lora_rank = max_models, max_lora_rank
        self.longpoll_s = longpoll_s
        self.limits = limits if limits is not None else Limits.from_env()
        self.sessions: dict[str, dict[str, Any]] = {}
        self.runs: dict[str, TrainingRun] = {}
        self.samplers: dict[str, SamplingSession] = {}
        self.results: dict[str, Result] = {}
        self.results_of: dict[str, OrderedDict[str, Result]] = {}  # each tenant's, oldest first
        self.created: dict[tuple[str, ...], Result] = {}  # creations by their dedupe key (pruned with their result)
        self.served: dict[tuple[str, str], tuple[str, Path]] = {}
        """(tenant, checkpoint name) -> the sampler's unique name for it and its folder: what ``/v1`` serves a tenant."""
        self.pool: LoRAPool | None = None
        self.sampler: Sampler | None = None  # made at start (:func:`~tracerl.tinker.samplers.make_sampler`)
        self.compute = FairQueue(max_queued_per_tenant=max_queued)
        self.sampling_gate = FairGate(slots=self.limits.sample_slots, max_queued_per_tenant=self.limits.max_samples_pending_per_tenant,
                                      active_s=self.limits.sample_share_active_s)
        self.adapters = SamplerAdapters(
            self._load_adapter, self._unload_adapter,
            max_total=self.limits.max_sampler_adapters, max_per_tenant=self.limits.max_sampler_adapters_per_tenant,
        )  # fmt: skip
        self.loop: asyncio.AbstractEventLoop | None = None
        self.background: set[asyncio.Task[Any]] = set()
        self.refused: dict[str, int] = {}  # 429s answered, per tenant
        self.usage = Usage()
        self.disk_reserved: dict[str, int] = {}  # bytes of saves admitted and not yet written, per tenant
        self.reserve_lock = threading.Lock()

    # -- life -----------------------------------------------------------------------
    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.root.mkdir(parents=True, exist_ok=True)
        self.usage.load(self.root / USAGE_FILE)
        self.pool = await asyncio.to_thread(functools.partial(LoRAPool, self.model_path, dtype=self.dtype))
        await asyncio.to_thread(self._resume)
        self.sampler = make_sampler(
            self.sampler_kind, self.model_path, served_name=self.model_name, dtype=self.dtype, max_batch_rows=self.limits.sample_batch_rows,
            max_loras=self.limits.max_sampler_adapters, max_lora_rank=self.max_lora_rank, **self.sampler_options,
        )  # fmt: skip
        await self.sampler.start()
        self.spawn(self._sweep_forever())
        log.info("tinker service: %s ready (checkpoints in %s; %s)", self.model_name, self.root, self.limits)

    async def close(self) -> None:
        for task in list(self.background):
            task.cancel()
        await asyncio.to_thread(self.compute.close)
        if self.sampler is not None:
            await self.sampler.stop()
        await asyncio.to_thread(self.usage.save, self.root / USAGE_FILE)

    def spawn(self, coroutine: Any) -> None:
        """Run ``coroutine`` in the background (kept referenced until done; a failure is logged)."""
        task = asyncio.ensure_future(coroutine)
        self.background.add(task)

        def done(task: asyncio.Task[Any]) -> None:
            self.background.discard(task)
            if not task.cancelled() and task.exception() is not None:
                log.error("tinker service: background task failed", exc_info=task.exception())

        task.add_done_callback(done)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                self.sweep()
                await asyncio.to_thread(self.usage.save, self.root / USAGE_FILE)
            except Exception:  # noqa: BLE001 - the next sweep tries again
                log.exception("tinker service: pruning the tables failed")

    def sweep(self) -> None:
        """Prune every tenant's answered or expired results, and ended sessions and sampling sessions."""
        now = time.monotonic()
        for tenant in list(self.results_of):
            self._prune_results(tenant, now)
        self._prune_sessions(None, now)
        self._prune_samplers(None, now)

    # -- the sampler's adapters (SamplerAdapters calls these in a worker thread) ------------------
    def _load_adapter(self, name: str, folder: Path) -> None:
        self.sampler.load_adapter(name, folder, folder.name)  # /v1 answers carry the tenant's own name

    def _unload_adapter(self, name: str) -> None:
        self.sampler.unload_adapter(name)

    def stats(self, tenant: str) -> dict[str, Any]:
        """The limits, the tenant's own counts, and the sampler's adapter counts (numbers, no names)."""
        return {
            "limits": asdict(self.limits),
            "tenant": {
                "sampler_adapters_loaded": self.adapters.count(tenant),
                "results": len(self.results_of.get(tenant, ())),
                "sessions": sum(1 for s in self.sessions.values() if s["tenant"] == tenant),
                "sampling_sessions": sum(1 for s in self.samplers.values() if s.tenant == tenant),
                "samples_pending": self.sampling_gate.pending(tenant),
                "training_queued": self.compute.queued(tenant),
                "refused_429": self.refused.get(tenant, 0),
                "usage": self.usage.of(tenant),
                "disk": self.disk(tenant),
            },
            "service": {
                "sampler_adapters_loaded": self.adapters.count(),
                "sampler_adapters_in_engine": self.sampler.adapters_loaded if self.sampler is not None else 0,
                "sampler_adapters_peak": self.adapters.peak,
                "sampler_adapter_loads": self.adapters.loads,
                "sampler_adapter_evictions": self.adapters.evictions,
            },
        }

    # -- disk and usage -------------------------------------------------------------------
    def disk_bytes(self, tenant: str) -> int:
        """Bytes of ``tenant``'s checkpoints on disk: every run's saved states and weights saved for sampling."""
        total = 0
        for run in self.runs_of(tenant):
            for kind in KINDS:
                try:
                    entries = list((self.root / run.model_id / kind).iterdir())
                except FileNotFoundError:
                    continue
                for entry in entries:  # a retired unnamed save being deleted no longer counts
                    if kind == "sampler_weights" and self.adapters.is_dropped(f"{run.model_id}@{entry.name}"):
                        continue
                    total += dir_bytes(entry) if entry.is_dir() else _size(entry)
        return total

    def disk(self, tenant: str) -> dict[str, Any]:
        """``tenant``'s disk use against its quota (what ``list_checkpoints`` and the stats report)."""
        return {
            "bytes": self.disk_bytes(tenant),
            "quota_bytes": self.limits.max_disk_bytes_per_tenant,
            "reserved_bytes": self.disk_reserved.get(tenant, 0),
            "checkpoints": sum(len(saved_in(self.root / run.model_id / kind)) for run in self.runs_of(tenant) for kind in KINDS),
        }

    def _reserve_disk(self, tenant: str, model_id: str, kind: str, replaced: Path | None) -> int:
        """Room for one more checkpoint of ``kind`` in run ``model_id``, or :class:`DiskFull` (429).  Its expected
        size is the run's newest checkpoint of that kind (none yet: 0, so a tenant under its quota can always
        make a run's first); ``replaced`` (a folder this save supersedes) does not count.  Returns the bytes
        reserved until the save is written (:meth:`_release_disk`), so saves admitted together fit together."""
        saved = saved_in(self.root / model_id / kind)
        expected = dir_bytes(max(saved, key=lambda folder: folder.stat().st_mtime)) if saved else 0
        used = self.disk_bytes(tenant) - (dir_bytes(replaced) if replaced is not None else 0)
        quota = self.limits.max_disk_bytes_per_tenant
        with self.reserve_lock:
            reserved = self.disk_reserved.get(tenant, 0)
            if used + reserved >= quota or used + reserved + expected > quota:
                raise self._refuse(tenant, DiskFull)(
                    f"your checkpoints use {used + reserved:,} bytes of your {quota:,}-byte disk quota here "
                    f"(max_disk_bytes_per_tenant); this save needs about {expected:,} more: delete checkpoints you no "
                    "longer need (RestClient.delete_checkpoint; list_checkpoints gives their sizes)", retry_after=30.0,
                )  # fmt: skip
            self.disk_reserved[tenant] = reserved + expected
        return expected

    def _release_disk(self, tenant: str, reserved: int) -> None:
        with self.reserve_lock:
            left = self.disk_reserved.get(tenant, 0) - reserved
            if left > 0:
                self.disk_reserved[tenant] = left
            else:
                self.disk_reserved.pop(tenant, None)

    def _metered(self, tenant: str, op: str, work: Callable[[], Any], counts: dict[str, int] | None = None, reserved: int | None = None) -> Callable[[], Any]:
        """``work``, its seconds (and ``counts``, which it may fill) added to ``tenant``'s usage when it ends;
        the disk it ``reserved`` released then."""
        counts = counts if counts is not None else {}

        def timed() -> Any:
            start = time.perf_counter()
            try:
                return work()
            finally:
                if reserved is not None:
                    self._release_disk(tenant, reserved)
                self.usage.add(tenant, op, **counts, train_seconds=time.perf_counter() - start)

        return timed

    def _sequenced_save(self, tenant: str, model_id: str, seq_id: int, op: str, work: Callable[[], Any], kind: str, replaced: Path | None) -> Result:
        """A save in its place in the sequence, admitted against the tenant's disk quota (a retry is not counted again)."""
        run = self.run_of(tenant, model_id)
        if seq_id in run.by_seq:
            return self.sequenced(tenant, model_id, seq_id, work)
        reserved = self._reserve_disk(tenant, model_id, kind, replaced)
        try:
            return self.sequenced(tenant, model_id, seq_id, self._metered(tenant, op, work, reserved=reserved))
        except BaseException:
            self._release_disk(tenant, reserved)
            raise

    def _resume(self) -> None:
        """Every run recorded under ``root``, its adapter from its newest saved state (a fresh one if none)."""
        assert self.pool is not None
        for record in sorted(self.root.glob("*/run.json")):
            folder, saved = record.parent, json.loads(record.read_text())
            for kind in KINDS:
                for action in repair_dir(folder / kind):
                    log.warning("tinker service: %s", action)
            run = TrainingRun(
                folder.name, saved["tenant"], saved["session_id"], saved["base_model"], AdapterSpec(**saved["spec"]),
                saved.get("user_metadata"), now_iso(), next_seq=0,
            )  # fmt: skip
            self.runs[run.model_id] = run
            self.sessions.setdefault(run.session_id, new_session(run.tenant, None))
            for weights in sorted(saved_in(folder / "sampler_weights"), key=lambda saved: saved.stat().st_mtime):
                if (weights / EPHEMERAL_MARK).exists():  # its sampling session ended with the old server
                    remove_dir(weights)
                    continue
                self.served[run.tenant, weights.name] = (served_name(f"tinker://{run.model_id}/sampler_weights/{weights.name}"), weights)
            states = sorted(saved_in(folder / "weights"), key=lambda state: state.stat().st_mtime)
            if states:
                self.pool.load(run.model_id, states[-1], with_optimizer=(states[-1] / "optimizer.pt").exists())
            else:
                self.pool.create(run.model_id, run.spec)
            log.info("tinker service: resumed %s (%s) from %s", run.model_id, run.tenant, states[-1].name if states else "its start")

    def tenant_of(self, key: str | None) -> str | None:
        """The tenant of API key ``key`` (None: not a key of this server); compared in constant time."""
        if self.keys is None:
            return DEFAULT_TENANT
        found = None
        for known, tenant in self.keys.items():
            if hmac.compare_digest(known.encode(), (key or "").encode()):
                found = tenant
        return found

    async def openai_name(self, tenant: str, requested: str, hold: contextlib.AsyncExitStack) -> str | None:
        """The sampler's name for what ``tenant`` asks ``/v1`` for: the base model, or one of its
        weights saved for sampling by checkpoint name (``agent@3``: its newest run's); None: not ours.
        Weights are loaded (again, if evicted) and kept from eviction until ``hold`` closes: the
        request's answer has been relayed."""
        if requested in self.sampler.base_names:
            return requested
        found = self.served.get((tenant, requested))
        if found is None:
            return None
        internal, folder = found
        try:
            await hold.enter_async_context(self.adapters.use(internal, tenant, folder))
        except (LookupError, ConfigError):  # dropped, or its folder deleted, meanwhile
            return None
        return internal

    @property
    def max_context_length(self) -> int:
        return self.sampler.max_model_len

    def check_base_model(self, name: str | None) -> str:
        if name is None or name == self.model_name or name.lower() in EMBEDDED_ALIASES and self.model_name == EMBEDDED_NAME:
            return self.model_name
        raise ConfigError(f"base_model {name!r} is not offered here; this server trains {self.model_name!r}")

    # -- sessions ---------------------------------------------------------------------
    def create_session(self, tenant: str, user_metadata: dict[str, Any] | None) -> str:
        now = time.monotonic()
        if self._count_sessions(tenant) >= self.limits.max_sessions_per_tenant:
            self._prune_sessions(tenant, now)
        if self._count_sessions(tenant) >= self.limits.max_sessions_per_tenant:
            raise self._refuse(tenant, TableFull)(
                f"you have {self.limits.max_sessions_per_tenant} open sessions here (the most allowed): finish one "
                "(ServiceClient.close / holder shutdown) or let it expire", retry_after=5.0,
            )  # fmt: skip
        session_id = f"s{uuid.uuid4().hex[:16]}"
        self.sessions[session_id] = new_session(tenant, user_metadata)
        return session_id

    def _count_sessions(self, tenant: str) -> int:
        return sum(1 for session in self.sessions.values() if session["tenant"] == tenant)

    def session(self, tenant: str, session_id: str) -> dict[str, Any]:
        session = self.sessions.get(session_id)
        if session is None or session["tenant"] != tenant:
            raise NotFound(f"unknown session {session_id!r}: create one first")
        return session

    def heartbeat(self, tenant: str, session_id: str) -> None:
        session = self.session(tenant, session_id)
        if session["finished"] is not None:
            raise Gone(f"session {session_id} has finished")
        session["heartbeat"] = time.monotonic()

    def finish(self, tenant: str, session_id: str) -> None:
        self._end_session(session_id, self.session(tenant, session_id), time.monotonic())

    def _end_session(self, session_id: str, session: dict[str, Any], now: float) -> None:
        """Finished (410 to a heartbeat until pruned); its sampling sessions end with it."""
        if session["finished"] is None:
            session["finished"] = now
            for sampling_id, sampler in list(self.samplers.items()):
                if sampler.session_id == session_id:
                    self._end_sampler(sampling_id)

    def _prune_sessions(self, tenant: str | None, now: float) -> None:
        """End the sessions without a heartbeat for ``session_idle_s``; forget those ended ``result_grace_s`` ago."""
        for session_id, session in list(self.sessions.items()):
            if tenant is not None and session["tenant"] != tenant:
                continue
            if session["finished"] is None and now - session["heartbeat"] >= self.limits.session_idle_s:
                self._end_session(session_id, session, now)
            if session["finished"] is not None and now - session["finished"] >= self.limits.result_grace_s:
                del self.sessions[session_id]

    # -- futures ----------------------------------------------------------------------
    def new_result(self, tenant: str) -> Result:
        """A new future of ``tenant``'s (:class:`TableFull` when its table is full of pending or unexpired ones)."""
        now = time.monotonic()
        self._prune_results(tenant, now)
        table = self.results_of.setdefault(tenant, OrderedDict())
        if len(table) >= self.limits.max_results_per_tenant:
            waits = [self._prunable_in(result, now) for result in table.values() if result.finished is not None]
            raise self._refuse(tenant, TableFull)(
                f"you hold {len(table)} futures here (the most allowed): poll the finished ones, or wait for the pending ones",
                retry_after=min(max(min(waits, default=1.0), 1.0), 60.0),
            )  # fmt: skip
        result = Result(f"r{uuid.uuid4().hex}", tenant)
        self.results[result.request_id] = table[result.request_id] = result
        return result

    def _refuse(self, tenant: str, error: type[QueueFullError]) -> type[QueueFullError]:
        """``error``, counted as one more 429 answered to ``tenant``."""
        self.refused[tenant] = self.refused.get(tenant, 0) + 1
        return error

    def _prunable_in(self, result: Result, now: float) -> float:
        assert result.finished is not None
        left = result.finished + self.limits.result_ttl_s - now
        if result.answered is not None:
            left = min(left, result.answered + self.limits.result_grace_s - now)
        return left

    def _prune_results(self, tenant: str, now: float) -> None:
        """Forget ``tenant``'s results answered ``result_grace_s`` ago or finished ``result_ttl_s`` ago (never a pending one)."""
        table = self.results_of.get(tenant)
        if table is None:
            return
        for request_id, result in list(table.items()):
            if result.finished is not None and self._prunable_in(result, now) <= 0:
                del table[request_id]
                self.results.pop(request_id, None)
                for key in result.keys:
                    if self.created.get(key) is result:
                        del self.created[key]
        if not table:
            del self.results_of[tenant]

    def run(self, result: Result, work: Callable[[], dict[str, Any] | bytes], *, force: bool = False) -> None:
        """``work`` on the compute thread, in the tenant's turn; ``result`` is set on the event loop when it ends."""
        assert self.loop is not None
        loop = self.loop
        future = self.compute.submit(result.tenant, work, force=force)
        future.add_done_callback(lambda done: loop.call_soon_threadsafe(self.settle, result, done))

    def settle(self, result: Result, future: concurrent.futures.Future[Any] | asyncio.Future[Any]) -> None:
        error = future.exception() if not future.cancelled() else RuntimeError("the server is shutting down")
        if error is None:
            result.payload = future.result()
        elif isinstance(error, USER_ERRORS):
            result.error = (f"{type(error).__name__}: {error}", "user")
        elif isinstance(error, NotFound):
            result.error = (f"NotFound: {error}", "user")
        else:
            log.error("tinker operation failed", exc_info=error)
            result.error = (f"{type(error).__name__}: {error}", "server")
        result.finished = time.monotonic()
        result.done.set()

    async def wait(self, tenant: str, request_id: str) -> Result | None:
        """The finished result, or None if it is still running after the long-poll window."""
        result = self.results.get(request_id)
        if result is None or result.tenant != tenant:
            raise NotFound(f"unknown or expired request_id {request_id!r}")
        try:
            await asyncio.wait_for(result.done.wait(), self.longpoll_s)
        except TimeoutError:
            return None
        if result.answered is None:
            result.answered = time.monotonic()  # pruned result_grace_s from now: a lost answer can be polled again
        return result

    def once(self, tenant: str, key: tuple[str, ...], work: Callable[[], dict[str, Any] | bytes]) -> Result:
        """``work`` once per ``key`` (a creation the SDK may retry); a retry gets the same result."""
        if key not in self.created:
            result = self.new_result(tenant)
            self.run(result, work)
            self.created[key] = result
            result.keys.append(key)
        return self.created[key]

    def sequenced(self, tenant: str, model_id: str, seq_id: int, work: Callable[[], dict[str, Any] | bytes]) -> Result:
        """Run ``work`` as request ``seq_id`` of ``model_id``: after every earlier one, once."""
        run = self.run_of(tenant, model_id)
        run.last_request_time = now_iso()
        if seq_id in run.by_seq:  # a retry of a request already accepted
            return run.by_seq[seq_id]
        if run.next_seq == 0:  # resumed after a restart: the client's numbering continues from here
            run.next_seq = seq_id
        if seq_id < run.next_seq:
            raise ConfigError(f"seq_id {seq_id} of {model_id} was answered and forgotten; the client must use a new one")
        if seq_id == run.next_seq and self.compute.queued(tenant) >= self.compute.max_queued:
            raise self._refuse(tenant, QueueFullError)(f"{self.compute.max_queued} operations of yours are queued already: wait for some to finish")
        result = self.new_result(tenant)  # TableFull before anything of the request is kept
        run.by_seq[seq_id] = result
        run.waiting[seq_id] = lambda: self.run(result, work, force=True)
        while run.next_seq in run.waiting:  # start the requests that are now in order
            run.waiting.pop(run.next_seq)()
            run.by_seq.pop(run.next_seq - 64, None)  # a retry comes within a few requests
            run.next_seq += 1
        return result

    def run_of(self, tenant: str, model_id: str) -> TrainingRun:
        run = self.runs.get(model_id)
        if run is None or run.tenant != tenant:
            raise NotFound(f"unknown training run {model_id!r}")
        return run

    def runs_of(self, tenant: str) -> list[TrainingRun]:
        return [run for run in self.runs.values() if run.tenant == tenant]

    # -- training -----------------------------------------------------------------------
    def _new_run(self, tenant: str, session_id: str, model_seq_id: int, base: str, spec: AdapterSpec, user_metadata: Any) -> str:
        self.session(tenant, session_id)
        model_id = f"{session_id}:train:{model_seq_id}"
        if model_id not in self.runs:
            if len(self.runs_of(tenant)) >= self.max_models:
                raise Forbidden(f"you have {self.max_models} training runs here already (the most allowed)")
            if spec.rank > self.max_lora_rank:
                raise Forbidden(f"LoRA rank {spec.rank} is above this server's limit of {self.max_lora_rank}")
            self.runs[model_id] = TrainingRun(model_id, tenant, session_id, base, spec, user_metadata, now_iso())
            record = {"tenant": tenant, "session_id": session_id, "base_model": base, "spec": asdict(spec), "user_metadata": user_metadata}
            (self.root / model_id).mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.root / model_id / "run.json", json.dumps(record))
        return model_id

    def create_model(self, tenant: str, session_id: str, model_seq_id: int, base_model: str, spec: AdapterSpec, user_metadata: Any) -> tuple[str, Result]:
        model_id = self._new_run(tenant, session_id, model_seq_id, self.check_base_model(base_model), spec, user_metadata)

        def work() -> dict[str, Any]:
            assert self.pool is not None
            self.pool.create(model_id, spec)
            return {"model_id": model_id, "type": "create_model"}

        return model_id, self.once(tenant, ("create", model_id), self._metered(tenant, "create_model", work))

    def create_from_checkpoint(self, tenant: str, session_id: str, model_seq_id: int, path: str, optimizer: bool, user_metadata: Any) -> tuple[str, Result]:
        """A new training run starting from a saved state (``create_training_client_from_state``)."""
        folder = self.checkpoint_folder(tenant, path)
        source = self.run_of(tenant, parse_path(path)[0])
        model_id = self._new_run(tenant, session_id, model_seq_id, source.base_model, source.spec, user_metadata)

        def work() -> dict[str, Any]:
            assert self.pool is not None
            self.pool.load(model_id, folder, with_optimizer=optimizer)
            return {"path": path, "model_id": model_id, "type": "load_weights"}

        return model_id, self.once(tenant, ("load", model_id), self._metered(tenant, "load_weights", work))

    def forward_backward(self, tenant: str, request: Any) -> Result:
        """A ``wire.ForwardBackward``: checked and decoded on the compute thread, so a bad one
        fails as its future and still takes its place in the sequence."""
        from .losses import check_loss_fn
        from .wire import datums, forward_backward_output

        counts: dict[str, int] = {}

        def work() -> bytes:
            assert self.pool is not None
            check_loss_fn(request.loss_fn, request.loss_fn_config)
            data = datums(request)
            counts["tokens_forward" if request.forward_only else "tokens_trained"] = sum(len(datum.tokens) for datum in data)
            logprobs, loss = self.pool.forward(request.model_id, data, request.loss_fn, request.loss_fn_config, backward=not request.forward_only)
            return forward_backward_output(logprobs, {"loss:sum": loss})

        op = "forward" if request.forward_only else "forward_backward"
        return self.sequenced(tenant, request.model_id, request.seq_id, self._metered(tenant, op, work, counts))

    def optim_step(self, tenant: str, model_id: str, seq_id: int, adam: dict[str, float]) -> Result:
        def work() -> dict[str, Any]:
            assert self.pool is not None
            return {"metrics": self.pool.optim_step(model_id, **adam), "type": "optim_step"}

        return self.sequenced(tenant, model_id, seq_id, self._metered(tenant, "optim_step", work))

    def save_state(self, tenant: str, model_id: str, seq_id: int, name: str | None) -> Result:
        """(A bad name fails as the future, in its place in the sequence: a request refused before it
        would leave a hole in the run's ``seq_id`` numbering that stalls every later request.)"""
        name = name or f"state-{seq_id}"

        def work() -> dict[str, Any]:
            assert self.pool is not None
            check_name(name)
            with atomic_dir(self._folder(model_id, "weights", name)) as folder:
                self.pool.save(model_id, folder, with_optimizer=True)
            return {"path": f"tinker://{model_id}/weights/{name}", "type": "save_weights"}

        replaced = self._folder(model_id, "weights", name) if ok_name(name) else None
        return self._sequenced_save(tenant, model_id, seq_id, "save_weights", work, "weights", replaced)

    def load_state(self, tenant: str, model_id: str, seq_id: int, path: str, optimizer: bool) -> Result:
        def work() -> dict[str, Any]:
            assert self.pool is not None
            folder = self.checkpoint_folder(tenant, path)  # failing in its place in the sequence (see save_state)
            self.pool.load(model_id, folder, with_optimizer=optimizer)
            return {"path": path, "model_id": model_id, "type": "load_weights"}

        return self.sequenced(tenant, model_id, seq_id, self._metered(tenant, "load_weights", work))

    def save_for_sampler(self, tenant: str, model_id: str, seq_id: int, name: str | None, sampling_session_seq_id: int | None) -> Result:
        """Save the adapter for sampling (served as ``<run>@<name>``, loaded when first used); unnamed: an
        ephemeral save with a sampling session of its own, which supersedes the run's previous one."""
        run = self.run_of(tenant, model_id)
        if name is None and run.ephemeral is None and seq_id not in run.by_seq:  # a new sampling session, not one replaced
            self._room_for_sampler(tenant)
        assert self.loop is not None
        loop = self.loop

        def work() -> dict[str, Any]:
            assert self.pool is not None
            saved = check_name(name) if name is not None else f"ephemeral-{seq_id}"  # in its place in the sequence
            folder = self._folder(model_id, "sampler_weights", saved)
            with atomic_dir(folder) as written:
                self.pool.save(model_id, written, with_optimizer=False)
                if name is None:
                    (written / EPHEMERAL_MARK).write_text("")
            path = f"tinker://{model_id}/sampler_weights/{saved}"
            # on the event loop before this result is settled (callbacks run in the order they were queued)
            loop.call_soon_threadsafe(self._saved_for_sampler, tenant, run, path, folder, sampling_session_seq_id if name is None else None)
            if name is not None:
                return {"path": path, "type": "save_weights_for_sampler"}
            return {"sampling_session_id": f"{run.session_id}:sample:{sampling_session_seq_id}", "type": "save_weights_for_sampler"}

        if name is None:  # supersedes the run's previous unnamed save, deleted once this one is written
            replaced = self._folder(*parse_path(run.ephemeral)) if run.ephemeral is not None else None
        else:
            replaced = self._folder(model_id, "sampler_weights", name) if ok_name(name) else None
        return self._sequenced_save(tenant, model_id, seq_id, "save_weights_for_sampler", work, "sampler_weights", replaced)

    def _saved_for_sampler(self, tenant: str, run: TrainingRun, path: str, folder: Path, sampling_seq: int | None) -> None:
        internal = served_name(path)
        self.adapters.stale(internal)  # saved again under a name in use: the next sample loads the new weights
        self.served[tenant, folder.name] = (internal, folder)
        if sampling_seq is None:
            return
        previous, run.ephemeral = run.ephemeral, path
        sampling_id = f"{run.session_id}:sample:{sampling_seq}"
        self.samplers[sampling_id] = SamplingSession(tenant, run.base_model, path, run.session_id)
        if previous is not None and previous != path:
            self._drop_ephemeral(previous)

    def _drop_ephemeral(self, path: str) -> None:
        """An unnamed save for sampling retired: its sampling sessions end; unloaded and deleted once no request uses it."""
        model_id, _, name = parse_path(path)
        run = self.runs.get(model_id)
        if run is not None and run.ephemeral == path:
            run.ephemeral = None
        for sampling_id, sampler in list(self.samplers.items()):
            if sampler.model_path == path:
                del self.samplers[sampling_id]
        internal = served_name(path)
        if run is not None and self.served.get((run.tenant, name), ("",))[0] == internal:
            del self.served[run.tenant, name]
        self.spawn(self.adapters.drop(internal, functools.partial(remove_dir, self._folder(model_id, "sampler_weights", name))))

    # -- sampling -------------------------------------------------------------------------
    def create_sampling_session(self, tenant: str, session_id: str, seq: int, model_path: str | None, base_model: str | None) -> str:
        self.session(tenant, session_id)
        sampling_id = f"{session_id}:sample:{seq}"
        if sampling_id not in self.samplers:
            if model_path is not None:
                self.checkpoint_folder(tenant, model_path)
                base = self.run_of(tenant, parse_path(model_path)[0]).base_model
            else:
                base = self.check_base_model(base_model)
            self._room_for_sampler(tenant)
            self.samplers[sampling_id] = SamplingSession(tenant, base, model_path, session_id)
        return sampling_id

    def _room_for_sampler(self, tenant: str) -> None:
        count = sum(1 for sampler in self.samplers.values() if sampler.tenant == tenant)
        if count >= self.limits.max_sampling_sessions_per_tenant:
            self._prune_samplers(tenant, time.monotonic())
            count = sum(1 for sampler in self.samplers.values() if sampler.tenant == tenant)
        if count >= self.limits.max_sampling_sessions_per_tenant:
            raise self._refuse(tenant, TableFull)(
                f"you have {count} sampling sessions here (the most allowed): reuse a sampling client, or finish the "
                f"session that made them; one unused for {self.limits.sampling_session_idle_s:g} s ends", retry_after=5.0,
            )  # fmt: skip

    def _prune_samplers(self, tenant: str | None, now: float) -> None:
        """End the sampling sessions unused for ``sampling_session_idle_s`` (none with a request running)."""
        for sampling_id, sampler in list(self.samplers.items()):
            if tenant is not None and sampler.tenant != tenant:
                continue
            if sampler.running == 0 and now - sampler.used >= self.limits.sampling_session_idle_s:
                self._end_sampler(sampling_id)

    def _end_sampler(self, sampling_id: str) -> None:
        sampler = self.samplers.pop(sampling_id)
        if sampler.model_path is not None and (run := self.runs.get(parse_path(sampler.model_path)[0])) is not None and run.ephemeral == sampler.model_path:
            self._drop_ephemeral(sampler.model_path)

    def sampling_session(self, tenant: str, sampling_id: str) -> SamplingSession:
        session = self.samplers.get(sampling_id)
        if session is None or session.tenant != tenant:
            raise NotFound(f"unknown sampling session {sampling_id!r} (or it ended: its session finished, a newer unnamed save replaced its weights, or it was idle)")
        return session

    def check_sample(self, prompt: list[int], num_samples: int, params: dict[str, Any]) -> int:
        """A sampling request within the per-request limits (``ConfigError``, answered 400, otherwise); its ``max_tokens``."""
        limits = self.limits
        if not 1 <= num_samples <= limits.max_num_samples:
            raise ConfigError(f"num_samples={num_samples}: this server takes 1 to {limits.max_num_samples} samples a request")
        if not prompt:
            raise ConfigError("the prompt is empty")
        if len(prompt) > limits.max_prompt_tokens:
            raise ConfigError(f"the prompt has {len(prompt)} tokens; this server takes at most {limits.max_prompt_tokens} (max_prompt_tokens)")
        vocab = self.sampler.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ConfigError(f"the prompt must be token ids in [0, {vocab})")
        room = self.max_context_length - len(prompt)
        max_tokens = params.get("max_tokens")
        if max_tokens is None:
            return max(min(room, limits.max_sample_tokens), 1)
        if max_tokens > limits.max_sample_tokens:
            raise ConfigError(f"max_tokens={max_tokens}: this server samples at most {limits.max_sample_tokens} tokens a request (max_sample_tokens)")
        if max_tokens > room:
            raise ConfigError(f"{len(prompt)} prompt tokens plus max_tokens={max_tokens} exceed the context of {self.max_context_length}")
        if max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {max_tokens}")
        return int(max_tokens)

    def sample(self, tenant: str, sampling_id: str, seq_id: int, prompt: list[int], num_samples: int, params: dict[str, Any], prompt_logprobs: bool) -> Result:
        """Sampled on the inference server's own thread (beside training), once per ``(session, seq_id)``, when
        the fair admission lets it in: checked against the per-request limits (400) and the tenant's quotas (429) first."""
        session = self.sampling_session(tenant, sampling_id)
        key = ("sample", sampling_id, str(seq_id))
        if key in self.created:
            return self.created[key]
        max_tokens = self.check_sample(prompt, num_samples, params)
        try:
            ticket = self.sampling_gate.enter(tenant)
        except QueueFullError:
            self._refuse(tenant, QueueFullError)
            raise
        try:
            result = self.new_result(tenant)
        except BaseException:
            self.sampling_gate.leave(tenant, ticket)
            raise
        self.created[key] = result
        result.keys.append(key)
        adapter = served_name(session.model_path) if session.model_path is not None else None
        if adapter is not None:
            self.adapters.ref(adapter)
        session.running += 1
        session.used = time.monotonic()

        counts = {"tokens_sampled": 0, "prompt_tokens_sampled": len(prompt)}

        async def admitted() -> bytes:
            start: float | None = None
            try:
                await ticket
                start = time.perf_counter()
                if adapter is None:
                    return await self._sample(None, prompt, num_samples, {**params, "max_tokens": max_tokens}, prompt_logprobs, counts)
                folder = self.checkpoint_folder(tenant, session.model_path)  # type: ignore[arg-type]
                try:
                    async with self.adapters.use(adapter, tenant, folder):
                        return await self._sample(adapter, prompt, num_samples, {**params, "max_tokens": max_tokens}, prompt_logprobs, counts)
                except LookupError as error:
                    raise NotFound(str(error)) from error
            finally:
                if start is not None:
                    op = "compute_logprobs" if prompt_logprobs and num_samples == 1 and max_tokens == 1 else "sample"
                    self.usage.add(tenant, op, **counts, sample_seconds=time.perf_counter() - start)
                self.sampling_gate.leave(tenant, ticket)
                session.running -= 1
                session.used = time.monotonic()
                if adapter is not None:
                    self.adapters.unref(adapter)

        task = asyncio.ensure_future(admitted())
        task.add_done_callback(lambda done: self.settle(result, done))
        return result

    async def _sample(self, adapter: str | None, prompt: list[int], n: int, params: dict[str, Any], with_prompt: bool, counts: dict[str, int]) -> bytes:
        """Sampled (``counts["tokens_sampled"]``: the tokens it generated)."""
        from .wire import sample_response

        stop = params.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        request = SampleRequest(
            prompt=prompt, adapter=adapter, n=n, max_tokens=params["max_tokens"], temperature=float(params.get("temperature", 1.0)),
            top_p=float(params.get("top_p", 1.0)), top_k=max(int(params.get("top_k", -1)), 0),
            stop=[s for s in stop if isinstance(s, str)], stop_token_ids=[s for s in stop if isinstance(s, int)],
            seed=params.get("seed"), with_prompt_logprobs=with_prompt,
        )  # fmt: skip
        samples, scored = await self.sampler.sample(request)
        counts["tokens_sampled"] += sum(len(s.token_ids) for s in samples)
        return sample_response([(s.token_ids, s.logprobs, s.finish_reason) for s in samples], scored)

    # -- checkpoints ----------------------------------------------------------------------
    def _folder(self, model_id: str, kind: str, name: str) -> Path:
        return self.root / model_id / kind / name

    def checkpoint_folder(self, tenant: str, path: str) -> Path:
        model_id, kind, name = parse_path(path)
        self.run_of(tenant, model_id)
        folder = self._folder(model_id, kind, name)
        if not folder.is_dir():
            raise NotFound(f"no checkpoint {path}")
        return folder

    def checkpoints(self, tenant: str, model_id: str) -> list[dict[str, Any]]:
        self.run_of(tenant, model_id)
        found = []
        for kind, checkpoint_type in KINDS.items():
            for folder in saved_in(self.root / model_id / kind):
                found.append({
                    "checkpoint_id": f"{kind}/{folder.name}",
                    "checkpoint_type": checkpoint_type,
                    "time": datetime.fromtimestamp(folder.stat().st_mtime, UTC).isoformat(),
                    "tinker_path": f"tinker://{model_id}/{kind}/{folder.name}",
                    "size_bytes": sum(f.stat().st_size for f in folder.iterdir()),
                    "public": False,
                })  # fmt: skip
        return found

    async def delete_checkpoint(self, tenant: str, model_id: str, checkpoint_id: str) -> None:
        path = f"tinker://{model_id}/{checkpoint_id}"
        folder = self.checkpoint_folder(tenant, path)
        if parse_path(path)[1] == "weights":
            await asyncio.to_thread(remove_dir, folder)
            return
        if self.served.get((tenant, folder.name), ("", None))[0] == served_name(path):
            del self.served[tenant, folder.name]
        for sampling_id, sampler in list(self.samplers.items()):
            if sampler.model_path == path:
                del self.samplers[sampling_id]
        run = self.runs[model_id]
        if run.ephemeral == path:
            run.ephemeral = None
        await self.adapters.drop(served_name(path), functools.partial(remove_dir, folder))


def read_keys(path: str | Path) -> dict[str, str]:
    """``--tinker-keys``: a JSON object of API key -> tenant (keys start with ``tml-``, as the SDK requires)."""
    import json

    from ..redact import register_secret

    keys = json.loads(Path(path).read_text())
    if not isinstance(keys, dict) or not keys or not all(isinstance(k, str) and isinstance(v, str) and v for k, v in keys.items()):
        raise ValueError(f"{path} must hold a JSON object of API key -> tenant name")
    short = [key[:4] + "..." for key in keys if not key.startswith("tml-") or len(key) < 16]
    if short:
        raise ValueError(f"{path}: every key must start with 'tml-' and be at least 16 characters (the SDK refuses others): {short}")
    for key in keys:
        register_secret(key)  # never in this process's logs, spans or files
    return keys


def saved_in(folder: Path) -> list[Path]:
    """The checkpoints in ``folder`` (not the temp entries of a write in progress or killed)."""
    return sorted(p for p in folder.glob("*") if p.is_dir() and not p.name.startswith("."))


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def new_session(tenant: str, user_metadata: dict[str, Any] | None) -> dict[str, Any]:
    return {"tenant": tenant, "finished": None, "heartbeat": time.monotonic(), "user_metadata": user_metadata}


def served_name(path: str) -> str:
    """The OpenAI model name weights saved for sampling are served under: ``<run>@<name>``."""
    model_id, _, name = parse_path(path)
    return f"{model_id}@{name}"
