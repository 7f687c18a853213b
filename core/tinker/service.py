"""The Tinker service behind ``tracerl serve``: sessions, training runs, sampling sessions, futures.

Every training client is a LoRA of one shared :class:`~tracerl.tinker.lora_pool.LoRAPool`; its
operations run one at a time on one compute thread, each run's strictly in the ``seq_id``
order the SDK numbers them (a retried request gets its first answer, never a second run).
Weights saved for sampling are loaded at once into one multi-LoRA
:class:`~tracerl.inference.transformers_server.TransformersServer`, where sampling runs
beside training.  Results are futures the SDK polls (:meth:`TinkerService.wait`).

Checkpoints live on disk under ``root/<training run>/{weights,sampler_weights}/<name>`` in
peft's layout, each written whole or not at all (:func:`tracerl.runs.durable.atomic_dir`);
their ``tinker://`` paths name them.  ``run.json`` beside them records the run's tenant and
settings, so a restarted server (after a SIGKILL too) resumes every run from its newest
saved state: what was saved is never lost, and the SDK's next request continues the run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import functools
import json
import logging
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
from .fair_queue import FairQueue, QueueFullError
from .lora_pool import AdapterSpec, LoRAPool

log = logging.getLogger("tracerl.tinker")

EMBEDDED_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
MAX_FUTURES = 10_000
"""Finished results kept for polling (the oldest forgotten first: a poll for it gets 404)."""
USER_ERRORS = (ConfigError, TrajectoryError, NonFiniteError, ValueError, TypeError, KeyError)
"""Failures the caller can fix: reported as category ``user``; anything else is ``server`` (and logged)."""
KINDS = {"weights": "training", "sampler_weights": "sampler"}
DEFAULT_TENANT = "default"


class NotFound(LookupError):
    """An unknown session, training run, sampling session, checkpoint or request id (answered 404)."""


class Gone(Exception):
    """A finished session (answered 410: the SDK stops its heartbeat)."""


class Forbidden(PermissionError):
    """Another tenant's session, run, sampler, checkpoint or result, or a quota reached (answered 403)."""


@dataclass
class Result:
    """One future: a JSON dict or protobuf bytes once done, or ``(message, category)`` on failure."""

    request_id: str
    tenant: str
    done: asyncio.Event = field(default_factory=asyncio.Event)
    payload: dict[str, Any] | bytes | None = None
    error: tuple[str, str] | None = None


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


@dataclass(frozen=True)
class SamplingSession:
    tenant: str
    base_model: str
    model_path: str | None  # tinker://... (None: the base model)


def now_iso() -> str:
    return datetime.now(UTC).isoformat()


def parse_path(path: str) -> tuple[str, str, str]:
    """``tinker://<run>/<weights|sampler_weights>/<name>`` → its three parts (``ConfigError`` otherwise)."""
    parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in KINDS or not all(parts):
        raise ConfigError(f"{path!r} is not a checkpoint path: tinker://<training run>/weights|sampler_weights/<name>")
    return parts[0], parts[1], parts[2]


def check_name(name: str) -> str:
    if not name or "/" in name or name in {".", ".."} or ":" in name:
        raise ConfigError(f"checkpoint name {name!r} must be non-empty, without '/' or ':'")
    return name


class TinkerService:
    """One base model's training runs and samplers, for one or many tenants (see the module docstring).

    ``keys`` maps each API key to its tenant; ``None``: one tenant, keyed by ``tracerl serve``'s
    token.  A tenant sees only its own sessions, runs, samplers, checkpoints and results
    (another's: :class:`Forbidden`).  Quotas per tenant: ``max_models`` training runs,
    ``max_lora_rank``, ``max_queued`` operations waiting on the compute thread.
    """

    def __init__(
        self, root: str | Path, *, base_model: str = "smollm2-135m", keys: Mapping[str, str] | None = None,
        max_models: int = 4, max_lora_rank: int = 64, max_queued: int = 256, longpoll_s: float = 35.0, dtype: str = "auto",
    ) -> None:  # fmt: skip
        """``dtype``: the base weights' format in the adapter pool and the sampler (``"auto"``: bf16 on a
        GPU, fp32 on a CPU; :data:`tracerl.inference.devices.DTYPES`)."""
        from ..inference.devices import DTYPES

        if dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(map(repr, DTYPES))}, got {dtype!r}")
        self.dtype = None if dtype == "auto" else dtype
        self.root = Path(root)
        self.model_path = resolve_base_model(base_model)
        self.model_name = EMBEDDED_NAME if base_model.lower() in EMBEDDED_ALIASES else base_model
        self.keys = dict(keys) if keys is not None else None
        self.max_models, self.max_lora_rank = max_models, max_lora_rank
        self.longpoll_s = longpoll_s
        self.sessions: dict[str, dict[str, Any]] = {}
        self.runs: dict[str, TrainingRun] = {}
        self.samplers: dict[str, SamplingSession] = {}
        self.results: OrderedDict[str, Result] = OrderedDict()
        self.created: dict[tuple[str, ...], Result] = {}  # creations by their dedupe key
        self.served: dict[tuple[str, str], tuple[str, Path]] = {}
        """(tenant, checkpoint name) -> the sampler's unique name for it and its folder: what ``/v1`` serves a tenant."""
        self.pool: LoRAPool | None = None
        self.sampler: Any = None  # TransformersServer
        self.compute = FairQueue(max_queued_per_tenant=max_queued)
        self.loop: asyncio.AbstractEventLoop | None = None

    # -- life -----------------------------------------------------------------------
    async def start(self) -> None:
        from ..inference.transformers_server import TransformersServer

        self.loop = asyncio.get_running_loop()
        self.root.mkdir(parents=True, exist_ok=True)
        self.pool = await asyncio.to_thread(functools.partial(LoRAPool, self.model_path, dtype=self.dtype))
        await asyncio.to_thread(self._resume)
        self.sampler = TransformersServer(self.model_path, served_name=self.model_name, dtype=self.dtype)
        await self.sampler.start()
        log.info("tinker service: %s ready (checkpoints in %s)", self.model_name, self.root)

    async def close(self) -> None:
        await asyncio.to_thread(self.compute.close)
        if self.sampler is not None:
            await self.sampler.stop()

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
            self.sessions.setdefault(run.session_id, {"tenant": run.tenant, "finished": False, "heartbeat": time.monotonic(), "user_metadata": None})
            for weights in sorted(saved_in(folder / "sampler_weights"), key=lambda saved: saved.stat().st_mtime):
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

    async def openai_name(self, tenant: str, requested: str) -> str | None:
        """The sampler's name for what ``tenant`` asks ``/v1`` for: the base model, or one of its
        weights saved for sampling by checkpoint name (``agent@3``: its newest run's); None: not ours."""
        if requested in self.sampler.base_names:
            return requested
        found = self.served.get((tenant, requested))
        if found is None:
            return None
        internal, folder = found
        if not self.sampler.engine.has_adapter(internal):  # saved before a restart
            await asyncio.to_thread(self.sampler.engine.load_adapter, internal, folder)
            self.sampler.answer_as[internal] = requested
        return internal

    @property
    def max_context_length(self) -> int:
        return int(self.sampler.engine.max_model_len)

    def check_base_model(self, name: str | None) -> str:
        if name is None or name == self.model_name or name.lower() in EMBEDDED_ALIASES and self.model_name == EMBEDDED_NAME:
            return self.model_name
        raise ConfigError(f"base_model {name!r} is not offered here; this server trains {self.model_name!r}")

    # -- sessions ---------------------------------------------------------------------
    def create_session(self, tenant: str, user_metadata: dict[str, Any] | None) -> str:
        session_id = f"s{uuid.uuid4().hex[:16]}"
        self.sessions[session_id] = {"tenant": tenant, "finished": False, "heartbeat": time.monotonic(), "user_metadata": user_metadata}
        return session_id

    def session(self, tenant: str, session_id: str) -> dict[str, Any]:
        session = self.sessions.get(session_id)
        if session is None:
            raise NotFound(f"unknown session {session_id!r}: create one first")
        owned(session["tenant"], tenant, f"session {session_id}")
        return session

    def heartbeat(self, tenant: str, session_id: str) -> None:
        session = self.session(tenant, session_id)
        if session["finished"]:
            raise Gone(f"session {session_id} has finished")
        session["heartbeat"] = time.monotonic()

    def finish(self, tenant: str, session_id: str) -> None:
        self.session(tenant, session_id)["finished"] = True

    # -- futures ----------------------------------------------------------------------
    def new_result(self, tenant: str) -> Result:
        result = Result(f"r{uuid.uuid4().hex}", tenant)
        self.results[result.request_id] = result
        while len(self.results) > MAX_FUTURES:
            self.results.popitem(last=False)
        return result

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
        else:
            log.error("tinker operation failed", exc_info=error)
            result.error = (f"{type(error).__name__}: {error}", "server")
        result.done.set()

    async def wait(self, tenant: str, request_id: str) -> Result | None:
        """The finished result, or None if it is still running after the long-poll window."""
        result = self.results.get(request_id)
        if result is None:
            raise NotFound(f"unknown or expired request_id {request_id!r}")
        owned(result.tenant, tenant, f"request {request_id}")
        try:
            await asyncio.wait_for(result.done.wait(), self.longpoll_s)
        except TimeoutError:
            return None
        return result

    def once(self, tenant: str, key: tuple[str, ...], work: Callable[[], dict[str, Any] | bytes]) -> Result:
        """``work`` once per ``key`` (a creation the SDK may retry); a retry gets the same result."""
        if key not in self.created:
            result = self.new_result(tenant)
            self.run(result, work)
            self.created[key] = result
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
            raise QueueFullError(f"{self.compute.max_queued} operations of yours are queued already: wait for some to finish")
        result = run.by_seq[seq_id] = self.new_result(tenant)
        run.waiting[seq_id] = lambda: self.run(result, work, force=True)
        while run.next_seq in run.waiting:  # start the requests that are now in order
            run.waiting.pop(run.next_seq)()
            run.by_seq.pop(run.next_seq - 64, None)  # a retry comes within a few requests
            run.next_seq += 1
        return result

    def run_of(self, tenant: str, model_id: str) -> TrainingRun:
        run = self.runs.get(model_id)
        if run is None:
            raise NotFound(f"unknown training run {model_id!r}")
        owned(run.tenant, tenant, f"training run {model_id}")
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

        return model_id, self.once(tenant, ("create", model_id), work)

    def create_from_checkpoint(self, tenant: str, session_id: str, model_seq_id: int, path: str, optimizer: bool, user_metadata: Any) -> tuple[str, Result]:
        """A new training run starting from a saved state (``create_training_client_from_state``)."""
        folder = self.checkpoint_folder(tenant, path)
        source = self.run_of(tenant, parse_path(path)[0])
        model_id = self._new_run(tenant, session_id, model_seq_id, source.base_model, source.spec, user_metadata)

        def work() -> dict[str, Any]:
            assert self.pool is not None
            self.pool.load(model_id, folder, with_optimizer=optimizer)
            return {"path": path, "model_id": model_id, "type": "load_weights"}

        return model_id, self.once(tenant, ("load", model_id), work)

    def forward_backward(self, tenant: str, request: Any) -> Result:
        """A ``wire.ForwardBackward``: checked and decoded on the compute thread, so a bad one
        fails as its future and still takes its place in the sequence."""
        from .losses import check_loss_fn
        from .wire import datums, forward_backward_output

        def work() -> bytes:
            assert self.pool is not None
            check_loss_fn(request.loss_fn, request.loss_fn_config)
            logprobs, loss = self.pool.forward(
                request.model_id, datums(request), request.loss_fn, request.loss_fn_config, backward=not request.forward_only
            )
            return forward_backward_output(logprobs, {"loss:sum": loss})

        return self.sequenced(tenant, request.model_id, request.seq_id, work)

    def optim_step(self, tenant: str, model_id: str, seq_id: int, adam: dict[str, float]) -> Result:
        def work() -> dict[str, Any]:
            assert self.pool is not None
            return {"metrics": self.pool.optim_step(model_id, **adam), "type": "optim_step"}

        return self.sequenced(tenant, model_id, seq_id, work)

    def save_state(self, tenant: str, model_id: str, seq_id: int, name: str | None) -> Result:
        name = check_name(name or f"state-{seq_id}")

        def work() -> dict[str, Any]:
            assert self.pool is not None
            with atomic_dir(self._folder(model_id, "weights", name)) as folder:
                self.pool.save(model_id, folder, with_optimizer=True)
            return {"path": f"tinker://{model_id}/weights/{name}", "type": "save_weights"}

        return self.sequenced(tenant, model_id, seq_id, work)

    def load_state(self, tenant: str, model_id: str, seq_id: int, path: str, optimizer: bool) -> Result:
        folder = self.checkpoint_folder(tenant, path)

        def work() -> dict[str, Any]:
            assert self.pool is not None
            self.pool.load(model_id, folder, with_optimizer=optimizer)
            return {"path": path, "model_id": model_id, "type": "load_weights"}

        return self.sequenced(tenant, model_id, seq_id, work)

    def save_for_sampler(self, tenant: str, model_id: str, seq_id: int, name: str | None, sampling_session_seq_id: int | None) -> Result:
        """Save the adapter and serve it at once (as ``<run>@<name>``); unnamed: also a sampling session."""
        run = self.run_of(tenant, model_id)
        if name is not None:
            check_name(name)

        def work() -> dict[str, Any]:
            assert self.pool is not None
            saved = name or f"ephemeral-{seq_id}"
            folder = self._folder(model_id, "sampler_weights", saved)
            with atomic_dir(folder) as written:
                self.pool.save(model_id, written, with_optimizer=False)
            path = f"tinker://{model_id}/sampler_weights/{saved}"
            self.sampler.engine.load_adapter(served_name(path), folder)
            self.sampler.answer_as[served_name(path)] = saved  # /v1 answers carry the tenant's own name
            self.served[tenant, saved] = (served_name(path), folder)
            if name is not None:
                return {"path": path, "type": "save_weights_for_sampler"}
            session_id = f"{run.session_id}:sample:{sampling_session_seq_id}"
            self.samplers[session_id] = SamplingSession(tenant, run.base_model, path)
            return {"sampling_session_id": session_id, "type": "save_weights_for_sampler"}

        return self.sequenced(tenant, model_id, seq_id, work)

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
            self.samplers[sampling_id] = SamplingSession(tenant, base, model_path)
        return sampling_id

    def sampling_session(self, tenant: str, sampling_id: str) -> SamplingSession:
        session = self.samplers.get(sampling_id)
        if session is None:
            raise NotFound(f"unknown sampling session {sampling_id!r}")
        owned(session.tenant, tenant, f"sampling session {sampling_id}")
        return session

    def sample(self, tenant: str, sampling_id: str, seq_id: int, prompt: list[int], num_samples: int, params: dict[str, Any], prompt_logprobs: bool) -> Result:
        """Sampled on the inference server's own thread (beside training); once per ``(session, seq_id)``."""
        session = self.sampling_session(tenant, sampling_id)
        key = ("sample", sampling_id, str(seq_id))
        if key in self.created:
            return self.created[key]
        result = self.created[key] = self.new_result(tenant)
        task = asyncio.ensure_future(self._sample(session, prompt, num_samples, params, prompt_logprobs))
        task.add_done_callback(lambda done: self.settle(result, done))
        return result

    async def _sample(self, session: SamplingSession, prompt: list[int], n: int, params: dict[str, Any], with_prompt: bool) -> bytes:
        from ..inference.engine import GenerationJob
        from .wire import sample_response

        engine = self.sampler.engine
        adapter = None
        if session.model_path is not None:
            adapter = served_name(session.model_path)
            if not engine.has_adapter(adapter):  # saved before a restart
                await asyncio.to_thread(engine.load_adapter, adapter, self.checkpoint_folder(session.tenant, session.model_path))
        if not prompt or min(prompt) < 0 or max(prompt) >= engine.vocab_size:
            raise TrajectoryError(f"the prompt must be token ids in [0, {engine.vocab_size})")
        stop = params.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        room = self.max_context_length - len(prompt)
        max_tokens = params.get("max_tokens") or room
        if max_tokens > room:
            raise ConfigError(f"{len(prompt)} prompt tokens plus max_tokens={max_tokens} exceed the context of {self.max_context_length}")
        job = GenerationJob(
            prompt_ids=prompt, adapter=adapter, n=n, temperature=float(params.get("temperature", 1.0)),
            top_p=float(params.get("top_p", 1.0)), top_k=max(int(params.get("top_k", -1)), 0), max_tokens=max_tokens,
            stop=[s for s in stop if isinstance(s, str)], stop_token_ids=[s for s in stop if isinstance(s, int)],
            seed=params.get("seed"),
        )  # fmt: skip
        scored = None
        if with_prompt:
            entries, last = await asyncio.to_thread(engine.prompt_logprobs, prompt, adapter)
            scored = [entry.logprob for entry in entries[1:]]
            if n == 1 and max_tokens == 1:  # compute_logprobs: the one token comes from the scoring pass
                one = engine.one_token(last, job.temperature, job.seed, top_p=job.top_p, top_k=job.top_k)
                finish = "stop" if one.token_ids[-1] in job.stop_token_ids else one.finish_reason
                return sample_response([(one.token_ids, one.logprobs, finish)], scored)
        samples = await asyncio.wrap_future(engine.submit(job))
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
        if self.served.get((tenant, folder.name), ("", None))[0] == served_name(path):
            del self.served[tenant, folder.name]
        if self.sampler.engine.has_adapter(served_name(path)):
            await self.sampler.unload_adapter(served_name(path))
        await asyncio.to_thread(remove_dir, folder)


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


def owned(owner: str, tenant: str, what: str) -> None:
    if owner != tenant:
        raise Forbidden(f"{what} belongs to another tenant")


def served_name(path: str) -> str:
    """The OpenAI model name weights saved for sampling are served under: ``<run>@<name>``."""
    model_id, _, name = parse_path(path)
    return f"{model_id}@{name}"
