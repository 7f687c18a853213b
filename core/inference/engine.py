"""The batched generation engine behind :class:`TransformersServer`.

A worker thread decodes one batch of rows with a KV cache, one token per row per forward pass.
Rows of different adapters (tenants) and of the base model share each forward: each row's own LoRA
is applied by :class:`~.multi_lora.BatchedLoRA` (one stacked product per layer, whatever the number
of adapters), or by peft's per-row ``adapter_names`` for adapters that cannot be stacked (DoRA,
``modules_to_save``, ...); a forward whose rows all use one adapter takes peft's plain path (the
common case of one policy served).  Jobs join a
running batch at the next decode step while it has room (``max_batch_rows``): their prompts are
prefilled in the same forward that decodes the running rows' next token (the running rows' slot
of that forward is masked padding before their one real token), and a job's prompt is prefilled
once for all its ``n`` samples (its cache row is then repeated).  Finished rows are dropped from
the batch and their request is answered at once.  A batch takes no new jobs once its padding
would more than double its longest row (:meth:`GenerationEngine._fits`); they start the next one.

A row's adapter is resolved when its job joins; an adapter replaced or unloaded while rows
still decode with it is deleted only after the last of them finishes.  The model lock is held
one decode step at a time, so adapters load between steps (a waiting load goes first).

Reported logprobs (and top logprobs) are those of the distribution each token was sampled
from, vLLM's ``processed_logprobs``: ``log_softmax`` of the logits divided by the temperature,
then top-k and top-p filtered exactly as :func:`sampling_logits` filters them for sampling (the
tokens filtered out at ``-inf``, the rest renormalised).  A turn sampled at temperature 0.7 is
thus recorded as sampled at 0.7, not at 1.  Greedy decoding (temperature below
:data:`~tracerl.types.GREEDY_BELOW`) is the exception: its distribution is a point mass, so it
reports the raw temperature-1 logprobs (as vLLM does); the turn's ``sampling`` says it was
greedy, and the trainer leaves greedy turns out of the policy loss.  Filtered tokens that a
``top_logprobs`` request still lists are reported at ``-9999.0`` (vLLM's floor: JSON has no
``-inf``).  Prompt logprobs (:meth:`GenerationEngine.prompt_logprobs`) are not sampled and stay raw.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import inspect
import itertools
import logging
import queue
import random
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from ..errors import ConfigError
from ..types import GREEDY_BELOW
from .multi_lora import BatchedLoRA

log = logging.getLogger(__name__)

LOGPROB_FLOOR = -9999.0
"""What a filtered-out token's ``-inf`` logprob is reported as (vLLM's floor for JSON)."""


def sampling_logits(logits: Any, temperature: float, top_p: float = 1.0, top_k: int = 0) -> Any:
    """The logits a token is sampled from (a ``[vocab]`` tensor, temperature > 0): ``logits / temperature``,
    then all but the ``top_k`` largest (ties kept) and all past the ``top_p`` nucleus at ``-inf``.

    The nucleus keeps the most likely tokens up to and including the first one at which the
    probability mass reaches ``top_p``.  ``log_softmax`` of the result is the sampled
    distribution's logprobs (what the engine reports)."""
    import torch

    scaled = logits / temperature
    if top_k and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(-1) - probs >= top_p  # keep the first past top_p
        scaled = scaled.clone()
        scaled[order[drop]] = float("-inf")
    return scaled


@dataclass
class SampleResult:
    """One sampled completion (one choice)."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: str
    text: str


@dataclass
class PromptLogprob:
    """One prompt token scored in context: its logprob and rank, and the ``top`` alternatives."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class GenerationJob:
    prompt_ids: list[int]
    adapter: str | None
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    top_logprobs: int = 0
    ignore_eos: bool = False
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    results: list[SampleResult | None] = field(default_factory=list)


@dataclass
class _Row:
    job: GenerationJob
    choice: int
    generator: Any
    internal: str | None = None  # the peft adapter it decodes with (None: the base model)
    released: bool = False  # done: no longer counted as using ``internal``
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass
class _Batch:
    """The rows being decoded and their KV cache (``mask``: ``[rows, width]``, padding at 0)."""

    rows: list[_Row] = field(default_factory=list)
    cache: Any = None
    mask: Any = None
    last_positions: Any = None  # [rows, 1]: each row's position of its newest token in the cache
    next_ids: list[int] = field(default_factory=list)  # each row's newest sampled token, fed next

    @property
    def width(self) -> int:
        return 0 if self.mask is None else int(self.mask.shape[1])

    def reset(self) -> None:
        self.rows, self.cache, self.mask, self.last_positions, self.next_ids = [], None, None, None, []


def _has_sliding_layers(cache: Any) -> bool:
    """Whether any layer of ``cache`` keeps a sliding window (or does not say): its window counts cache slots,
    so slots may be neither added after a row's tokens (a join) nor dropped."""
    return any(getattr(layer, "is_sliding", True) for layer in cache.layers)


def _append_rows(cache: Any, mask: Any, fresh: Any, fresh_mask: Any) -> Any:
    """Append ``fresh``'s rows (a cache of newly prefilled prompts) to ``cache`` as new rows, each side's
    positions masked for the other's rows (``[old | fresh]`` along the positions); return the mask.
    Attention reads keys by the mask and the keys carry their own positions, so where a row's
    positions lie in the cache does not matter."""
    import torch

    rows, width = mask.shape
    added, fresh_width = fresh_mask.shape
    for layer, new in zip(cache.layers, fresh.layers, strict=True):
        if layer.get_seq_length() == 0:
            continue
        for name in ("keys", "values"):
            old, joined = getattr(layer, name), getattr(new, name)
            top = torch.cat([old, old.new_zeros((*old.shape[:2], fresh_width, old.shape[-1]))], dim=-2)
            bottom = torch.cat([joined.new_zeros((*joined.shape[:2], width, joined.shape[-1])), joined], dim=-2)
            setattr(layer, name, torch.cat([top, bottom], dim=0))
    return torch.cat([torch.cat([mask, mask.new_zeros((rows, fresh_width))], dim=1),
                      torch.cat([fresh_mask.new_zeros((added, width)), fresh_mask], dim=1)])  # fmt: skip


def _drop_dead_positions(cache: Any, mask: Any) -> Any:
    """Drop the cache positions that are padding for every row left (the prompts of jobs that joined and
    have finished); return the mask without them.

    Why: each job that joins a running batch adds its prompt's width of positions to every row, so
    under staggered arrivals the cache would widen until :meth:`GenerationEngine._fits` turns new
    jobs away to wait for the batch to empty.  Positions are explicit (``position_ids``), so dropping
    padding changes no row's attention.  Skipped for caches with sliding-window layers, whose
    window counts positions, and unless a quarter of the width is dead (each drop copies the cache)."""
    live = mask.bool().any(dim=0)
    dead = int((~live).sum())
    if dead == 0 or 4 * dead < mask.shape[1] or _has_sliding_layers(cache):
        return mask
    index = live.nonzero().squeeze(-1)
    for layer in cache.layers:  # what the layers' own batch_select_indices does, on the positions' axis
        if layer.get_seq_length() > 0:
            layer.keys = layer.keys.index_select(-2, index)
            layer.values = layer.values.index_select(-2, index)
    return mask[:, index]


class GenerationEngine:
    """A causal LM plus run-time peft adapters, generating queued jobs in batches."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        max_batch_rows: int = 16,
        batch_wait_s: float = 0.02,
        num_threads: int | None = None,
        device: str | None = None,
        dtype: Any = None,
    ) -> None:
        """``device``: default CUDA when visible, else CPU; ``dtype``: default bf16 on CUDA, fp32 elsewhere
        (:func:`tracerl.inference.devices.dtype_for`).  On CUDA the free memory is checked before loading."""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from .devices import SERVE_OVERHEAD, check_room_for, default_device, dtype_for

        if num_threads:
            torch.set_num_threads(num_threads)
        self.model_path = Path(model_path)
        self.device = torch.device(device or default_device())
        self.dtype = dtype_for(self.device, dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        check_room_for(self.model_path, self.device, overhead=SERVE_OVERHEAD, what="the transformers server", dtype=self.dtype)
        self._base = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype).to(self.device).eval()
        self._peft: Any = None
        self._batched: BatchedLoRA | None = None  # per-row adapters in one product (hooks on peft's LoRA layers)
        self.max_model_len = int(getattr(self._base.config, "max_position_embeddings", 2048) or 2048)
        self.vocab_size = int(self._base.get_input_embeddings().num_embeddings)
        eos = {self.tokenizer.eos_token_id}
        gen_eos = getattr(self._base.generation_config, "eos_token_id", None)
        eos.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        self.eos_ids = {int(t) for t in eos if t is not None}
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else min(self.eos_ids))
        forward_params = inspect.signature(type(self._base).forward).parameters
        self._cache_arg = "cache" if "cache" in forward_params else "past_key_values"  # renamed in transformers 5.x
        self._adapters: dict[str, str] = {}  # served name -> internal peft adapter name
        self._counter = itertools.count()
        self._lock = threading.Lock()  # the model: one decode step, scoring pass or adapter change at a time
        self._counter_lock = threading.Lock()
        self._lock_waiters = 0  # callers other than the worker waiting for the lock (they go first)
        self._busy: collections.Counter[str] = collections.Counter()  # peft adapter -> rows decoding with it
        self._deferred: set[str] = set()  # adapters to delete once no row uses them
        self._running = threading.Event()
        self._running.set()
        self._queue: queue.Queue[GenerationJob | None] = queue.Queue()
        self._waiting: collections.deque[GenerationJob] = collections.deque()  # taken from the queue, not yet admitted
        self.max_batch_rows = max_batch_rows
        self.batch_wait_s = batch_wait_s
        self._worker: threading.Thread | None = None
        self.stats = {"batches": 0, "rows": 0, "max_rows": 0, "tokens": 0, "forwards": 0, "joins": 0, "max_adapters": 0,
                      "prompt_tokens": 0, "batched_lora": 0}
        """``batches``: batches started empty; ``rows``: rows admitted; ``max_rows``: most rows in one forward;
        ``joins``: jobs that joined a running batch; ``max_adapters``: most distinct adapters (the
        base model counted as one) in one forward; ``prompt_tokens``: prompt tokens prefilled (once a job,
        whatever its ``n``); ``batched_lora``: forwards of several adapters (or the base beside adapters) whose
        LoRA deltas :class:`~tracerl.inference.multi_lora.BatchedLoRA` computed (the others of them: peft's
        ``adapter_names``)."""

    # --- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="tracerl-generate", daemon=True)
            self._worker.start()

    def stop(self) -> None:
        self._running.set()
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join(60)
            self._worker = None
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None and not job.future.done():
                job.future.set_exception(RuntimeError("the inference server stopped"))

    @property
    def alive(self) -> bool:
        return self._worker is not None and self._worker.is_alive()

    def pause(self) -> None:
        """Hold generation at the next decode step (running batches included) until :meth:`resume`."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    @property
    def jobs_waiting(self) -> int:
        """Jobs submitted and not yet decoding (queued, or held while paused or while the batch is full)."""
        return self._queue.qsize() + len(self._waiting)

    # --- adapters --------------------------------------------------------------------
    @property
    def adapter_names(self) -> list[str]:
        return list(self._adapters)

    def has_adapter(self, name: str) -> bool:
        return name in self._adapters

    def load_adapter(self, name: str, path: str | Path) -> None:
        """Load (or replace in place) the peft adapter folder ``path`` served as ``name``."""
        from peft import PeftModel

        path = Path(path).expanduser()
        if not (path / "adapter_config.json").exists():
            raise ConfigError(f"no peft adapter at {path} (adapter_config.json is missing)")
        internal = f"adapter{next(self._counter)}"  # peft module keys must not hold '.', '@' may vary
        with self._model_lock():
            if self._peft is None:
                self._peft = PeftModel.from_pretrained(self._base, str(path), adapter_name=internal, is_trainable=False)
                self._peft.eval()
                self._batched = BatchedLoRA(self._peft)
            else:
                self._peft.load_adapter(str(path), adapter_name=internal, is_trainable=False)
                self._batched.refresh()
            old = self._adapters.get(name)
            self._adapters[name] = internal
            if old is not None:
                self._delete(old)

    def unload_adapter(self, name: str) -> None:
        """Stop serving ``name``: jobs that have not started get an error; rows decoding with it finish
        with it (the adapter is deleted after the last of them)."""
        with self._model_lock():
            internal = self._adapters.pop(name)
            self._delete(internal)

    @contextlib.contextmanager
    def _model_lock(self) -> Iterator[None]:
        """The model lock for a caller other than the worker, which lets it in at its next decode step."""
        with self._counter_lock:
            self._lock_waiters += 1
        try:
            with self._lock:
                yield
        finally:
            with self._counter_lock:
                self._lock_waiters -= 1

    def _delete(self, internal: str) -> None:
        if internal in self._adapters.values():
            return
        if self._busy[internal] > 0:
            self._deferred.add(internal)
            return
        if len(self._peft.peft_config) > 1:  # peft cannot drop its last adapter; it stays unused
            with warnings.catch_warnings():  # "adapter X was active which is now deleted"
                warnings.simplefilter("ignore", UserWarning)
                self._peft.delete_adapter(internal)
            self._batched.refresh()

    # --- submission ------------------------------------------------------------------
    def submit(self, job: GenerationJob) -> concurrent.futures.Future:
        if self._worker is None:
            raise RuntimeError("the generation engine is not running")
        job.results = [None] * job.n
        self._queue.put(job)
        return job.future

    def _work(self) -> None:
        """Admit queued jobs into the running batch at each decode step; run until stopped."""
        batch = _Batch()
        waiting = self._waiting
        stopping = False
        while True:
            if not batch.rows and not waiting:
                if stopping:
                    return
                job = self._queue.get()  # idle: wait for work, then a few ms for more to batch with it
                if job is None:
                    return
                waiting.append(job)
                deadline = time.monotonic() + self.batch_wait_s
                rows = job.n
                while rows < self.max_batch_rows:
                    try:
                        extra = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                    except queue.Empty:
                        break
                    if extra is None:
                        stopping = True
                        break
                    waiting.append(extra)
                    rows += extra.n
            while not stopping:  # jobs that came while the batch decoded join at this step if they fit
                try:
                    extra = self._queue.get_nowait()
                except queue.Empty:
                    break
                if extra is None:
                    stopping = True
                else:
                    waiting.append(extra)
            while self._lock_waiters:  # an adapter change or a scoring pass goes first
                time.sleep(0.0005)
            self._running.wait()  # paused: hold every row (and every new job) here, without the lock
            with self._lock:
                if not self._running.is_set():  # paused since: wait above
                    continue
                joining = self._admit(batch, waiting)
                if not batch.rows and not joining:
                    continue
                try:
                    self._step(batch, joining)
                except BaseException as error:  # noqa: BLE001 - handed to the waiting requests
                    log.exception("generation failed")
                    for row in batch.rows + [row for _, rows in joining for row in rows]:
                        if not row.job.future.done():
                            row.job.future.set_exception(error)
                    self._release(batch.rows + [row for _, rows in joining for row in rows])
                    batch = _Batch()

    def _admit(self, batch: "_Batch", waiting: collections.deque[GenerationJob]) -> list[tuple[GenerationJob, list[_Row]]]:
        """Take waiting jobs (in order) that fit into ``batch``, each with its rows (adapter resolved, marked busy)."""
        import torch

        joining: list[tuple[GenerationJob, list[_Row]]] = []
        rows = len(batch.rows)
        present = {row.internal for row in batch.rows}
        while waiting:
            job = waiting[0]
            empty = rows == 0
            if not empty and (rows + job.n > self.max_batch_rows or not self._fits(batch, [j for j, _ in joining] + [job])):
                break
            if not empty and not self._mixes(present | {self._adapters.get(job.adapter) if job.adapter is not None else None}):
                break  # its adapter cannot share a forward with the batch's: it starts the next batch
            waiting.popleft()
            if not job.future.set_running_or_notify_cancel():  # cancelled while queued
                continue
            try:
                internal = self._internal_for(job.adapter)
            except ConfigError as error:  # unloaded while the job waited
                job.future.set_exception(error)
                continue
            job_rows = []
            for choice in range(job.n):
                generator = torch.Generator(device=self.device)  # sampling happens where the logits are
                seed = job.seed * 1_000_003 + choice if job.seed is not None else random.SystemRandom().getrandbits(63)
                generator.manual_seed(seed % (2**63))
                job_rows.append(_Row(job=job, choice=choice, generator=generator, internal=internal))
                if internal is not None:
                    self._busy[internal] += 1  # replaced or unloaded meanwhile: deleted after its last row
            joining.append((job, job_rows))
            present.add(internal)
            rows += job.n
        if joining:
            self.stats["batches"] += 0 if batch.rows else 1
            self.stats["joins"] += len(joining) if batch.rows else 0
            self.stats["rows"] += sum(len(job_rows) for _, job_rows in joining)
        return joining

    def _mixes(self, internals: set[str | None]) -> bool:
        """Whether rows of these peft adapters (None: the base model) can share a forward: one adapter always;
        several when :class:`BatchedLoRA` stacks them all or peft's ``adapter_names`` takes them (not DoRA)."""
        adapters = {name for name in internals if name is not None}
        if len(internals) <= 1 or self._batched is None or all(self._batched.supports(name) for name in adapters):
            return True
        return not any(getattr(self._peft.peft_config.get(name), "use_dora", False) for name in adapters)

    def _fits(self, batch: "_Batch", jobs: list[GenerationJob]) -> bool:
        """Whether ``jobs`` may join the running ``batch``: its cache (padding included) then spans at most
        twice its longest row's tokens, plus 64 (a batch that takes no more empties and starts afresh).

        Never where the cache has sliding-window layers (Gemma 3, gpt-oss): transformers measures a
        window in cache slots, not positions, and keeps only a window's worth of them, so the slots a join
        adds after the running rows' tokens would push their oldest keys out of the window for good."""
        if batch.cache is not None and _has_sliding_layers(batch.cache):
            return False
        width = batch.width + max(len(job.prompt_ids) for job in jobs)
        longest = max([len(row.job.prompt_ids) + len(row.ids) for row in batch.rows] + [len(job.prompt_ids) for job in jobs])
        return width <= 2 * longest + 64

    def _release(self, rows: list[_Row]) -> None:
        """Rows done (finished or failed): delete the adapters that waited for them."""
        for row in rows:
            if row.released:
                continue
            row.released = True
            if row.internal is not None:
                self._busy[row.internal] -= 1
                if self._busy[row.internal] <= 0:
                    del self._busy[row.internal]
        for pending in [i for i in self._deferred if self._busy[i] <= 0]:
            self._deferred.discard(pending)
            self._delete(pending)

    # --- generation ------------------------------------------------------------------
    def _internal_for(self, adapter: str | None) -> str | None:
        if adapter is None:
            return None
        internal = self._adapters.get(adapter)
        if internal is None:
            raise ConfigError(f"adapter {adapter!r} is not loaded")
        return internal

    @contextlib.contextmanager
    def _selected(self, internal: str | None) -> Iterator[Any]:
        """The module to call with adapter ``internal`` active (None: the base model), for one pass
        (:meth:`prompt_logprobs`; decoding names each row's adapter instead)."""
        if self._peft is None:
            yield self._base
        elif internal is None:
            self._batched.peft_layers(on=False)  # the base model: no adapter computed
            yield self._peft
        else:
            self._batched.peft_layers(on=True)
            if self._peft.active_adapter != internal:
                self._peft.set_adapter(internal)
            yield self._peft

    def _wait_while_paused(self) -> None:
        """Called with the model lock held (a scoring pass): release it while paused so adapters can be loaded."""
        if self._running.is_set():
            return
        self._lock.release()
        try:
            self._running.wait()
        finally:
            self._lock.acquire()

    def _step(self, batch: "_Batch", joining: list[tuple[GenerationJob, list[_Row]]]) -> None:
        """One decode step: each running row's next token, and the prompts of the ``joining`` jobs (one cache
        row per job, repeated for its samples); then sample every row, answer and drop the finished ones.

        Joining prompts are prefilled in a forward of their own and their cache rows appended beside the
        running rows' (:func:`_append_rows`), so the running rows compute one position, not the prompts'
        width of padding (a cache with sliding-window layers takes no joins: :meth:`_fits`)."""
        import torch

        device = self.device
        running = len(batch.rows)
        prompts = [job.prompt_ids for job, _ in joining]
        names = [row.internal for row in batch.rows] + [rows[0].internal for _, rows in joining]
        self.stats["prompt_tokens"] += sum(len(prompt) for prompt in prompts)
        self.stats["max_adapters"] = max(self.stats["max_adapters"], len(set(names)))
        if running and prompts:
            decoded, cache, mask, positions = self._forward(batch.next_ids, [], batch, names[:running])
            prefilled, fresh, new_mask, new_positions = self._forward([], prompts, _Batch(), names[running:])
            mask = _append_rows(cache, mask, fresh, new_mask)
            logits, positions = torch.cat([decoded, prefilled]), torch.cat([positions[:, -1:], new_positions[:, -1:]])
        else:
            logits, cache, mask, positions = self._forward(batch.next_ids if running else [], prompts, batch, names)
        last = positions[:, -1:]
        rows = list(batch.rows)
        if any(job.n > 1 for job, _ in joining):  # a job's prompt was computed once: repeat it for each sample
            order = list(range(running)) + [running + j for j, (job, _) in enumerate(joining) for _ in range(job.n)]
            index = torch.tensor(order, dtype=torch.long, device=device)
            cache.batch_select_indices(index)
            mask, last, logits = mask[index], last[index], logits[index]
        for _, job_rows in joining:
            rows.extend(job_rows)
        self.stats["max_rows"] = max(self.stats["max_rows"], len(rows))
        next_ids: list[int] = []
        keep: list[int] = []
        done: list[_Row] = []
        with torch.inference_mode():
            for i, row in enumerate(rows):
                token = self._sample(row, logits[i])
                if self._finish(row):
                    done.append(row)
                    continue
                keep.append(i)
                next_ids.append(token)
        if done:
            self._release(done)
        if not keep:
            batch.reset()
            return
        if len(keep) < len(rows):
            index = torch.tensor(keep, dtype=torch.long, device=device)
            cache.batch_select_indices(index)
            mask, last = mask[index], last[index]
            rows = [rows[i] for i in keep]
            mask = _drop_dead_positions(cache, mask)
        batch.rows, batch.cache, batch.mask, batch.last_positions, batch.next_ids = rows, cache, mask, last, next_ids

    def _forward(self, next_ids: list[int], prompts: list[list[int]], batch: "_Batch", names: list[str | None]) -> tuple[Any, Any, Any, Any]:
        """One forward over ``batch``'s cache: the running rows' ``next_ids`` (one each) and the left-padded
        ``prompts`` (new cache rows).  Returns the last position's fp32 logits per row, the cache, its
        mask and the new positions."""
        import torch

        device = self.device
        running = len(next_ids)
        width = max([1 if running else 0] + [len(prompt) for prompt in prompts])  # the new positions of this pass
        size = running + len(prompts)
        input_ids = torch.full((size, width), self.pad_id, dtype=torch.long)
        new_mask = torch.zeros((size, width), dtype=torch.long)
        for i in range(running):  # masked padding, then the row's one real token
            input_ids[i, -1] = next_ids[i]
            new_mask[i, -1] = 1
        for j, prompt in enumerate(prompts):  # left-padded prompts
            input_ids[running + j, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            new_mask[running + j, width - len(prompt) :] = 1
        positions = (new_mask.cumsum(-1) - 1).clamp(min=0)
        input_ids, new_mask, positions = input_ids.to(device), new_mask.to(device), positions.to(device)
        if running:
            positions[:running] = batch.last_positions + 1  # padding's positions do not matter
        mask = new_mask
        if batch.cache is not None:
            old_mask = batch.mask
            if prompts:  # the joining jobs' rows of the cache: copies of row 0, all masked
                grown = torch.tensor(list(range(running)) + [0] * len(prompts), dtype=torch.long, device=device)
                batch.cache.batch_select_indices(grown)
                old_mask = torch.cat([old_mask, torch.zeros((len(prompts), old_mask.shape[1]), dtype=torch.long, device=device)])
            mask = torch.cat([old_mask, new_mask], dim=-1)
        self.stats["forwards"] += 1
        kwargs: dict[str, Any] = {}
        selected: contextlib.AbstractContextManager[Any] = contextlib.nullcontext(self._base)
        if self._peft is not None and len(set(names)) == 1 and names[0] is not None:  # one adapter for every row: peft's plain path
            selected = self._selected(names[0])
        elif self._batched is not None and all(name is None or self._batched.supports(name) for name in names):
            selected = self._batched.rows(names)  # several adapters (or the base): one stacked product per layer
            self.stats["batched_lora"] += 1
        elif self._peft is not None:  # peft wraps the base in place on the first load: always call it then
            self._batched.peft_layers(on=True)
            selected = contextlib.nullcontext(self._peft)
            kwargs["adapter_names"] = [name if name is not None else "__base__" for name in names]
        with torch.inference_mode(), selected as model:
            out = model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_arg: batch.cache},
                **kwargs,
            )
        return out.logits[:, -1, :].float(), getattr(out, self._cache_arg, None), mask, positions

    def prompt_logprobs(self, prompt_ids: list[int], adapter: str | None, top: int = 0) -> tuple[list[PromptLogprob | None], Any]:
        """Each prompt token's logprob given the tokens before it (vLLM's ``prompt_logprobs``; None first),
        and the logits after the last prompt token (so a one-token completion needs no second pass).

        One forward pass over the prompt, outside the batching queue but under the model lock
        (and held while a trainer has paused the server), with ``adapter`` active (None: base).
        """
        import torch

        with self._model_lock():
            self._wait_while_paused()
            internal = self._internal_for(adapter)
            ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
            with torch.inference_mode(), self._selected(internal) as model:
                logits = model(input_ids=ids, use_cache=False).logits[0].float()
        logprobs = torch.log_softmax(logits[:-1], dim=-1)
        targets = torch.tensor(prompt_ids[1:], dtype=torch.long, device=logprobs.device)
        chosen = logprobs.gather(-1, targets[:, None]).squeeze(-1)
        ranks = (logprobs > chosen[:, None]).sum(-1) + 1
        out: list[PromptLogprob | None] = [None]
        tops = torch.topk(logprobs, top) if top > 0 else None
        for i, token in enumerate(prompt_ids[1:]):
            alternatives = [] if tops is None else list(zip(tops.indices[i].tolist(), tops.values[i].tolist()))
            out.append(PromptLogprob(token, float(chosen[i]), int(ranks[i]), alternatives))
        return out, logits[-1]

    def one_token(
        self, logits: Any, temperature: float, seed: int | None, top: int = 0, *, top_p: float = 1.0, top_k: int = 0
    ) -> SampleResult:
        """A one-token completion sampled from ``logits`` (the last prompt position), as the decoder would."""
        import torch

        generator = torch.Generator(device=logits.device)
        generator.manual_seed((seed if seed is not None else random.SystemRandom().getrandbits(63)) % (2**63))
        job = GenerationJob(prompt_ids=[], adapter=None, temperature=temperature, top_p=top_p, top_k=top_k,
                            max_tokens=1, top_logprobs=top)  # fmt: skip
        row = _Row(job=job, choice=0, generator=generator)
        self._sample(row, logits)
        stop = row.ids[-1] in self.eos_ids
        return SampleResult(
            token_ids=row.ids, logprobs=row.logprobs, top_logprobs=row.top,
            finish_reason="stop" if stop else "length", text="" if stop else self.decode(row.ids),
        )

    def _sample(self, row: _Row, logits: Any) -> int:
        """Sample the row's next token from ``logits`` (``[vocab]``, fp32); record it with its logprob
        (and top logprobs) under the distribution it was sampled from (raw logprobs when greedy)."""
        import torch

        job = row.job
        if job.temperature < GREEDY_BELOW:
            token = int(torch.argmax(logits))
            logprobs = torch.log_softmax(logits, dim=-1)
        else:
            scaled = sampling_logits(logits, job.temperature, job.top_p, job.top_k)
            probs = torch.softmax(scaled, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=row.generator))
            logprobs = torch.log_softmax(scaled, dim=-1)
        row.ids.append(token)
        self.stats["tokens"] += 1
        row.logprobs.append(float(logprobs[token]))
        if job.top_logprobs:
            values, indices = torch.topk(logprobs, job.top_logprobs)
            values = values.clamp(min=LOGPROB_FLOOR)  # filtered tokens: -inf, which JSON cannot carry
            row.top.append([(int(t), float(v)) for t, v in zip(indices.tolist(), values.tolist())])
        return token

    def _finish(self, row: _Row) -> bool:
        """Record the row's result when it is done; answer its job when all its rows are."""
        job = row.job
        token = row.ids[-1]
        reason: str | None = None
        text_ids = row.ids
        if (token in self.eos_ids and not job.ignore_eos) or token in job.stop_token_ids:
            reason, text_ids = "stop", row.ids[:-1]
        text = None
        if reason is None and job.stop and self._stop_in_tail(row.ids, job.stop):
            decoded = self.decode(row.ids)
            hits = [decoded.find(s) for s in job.stop if s in decoded]
            if hits:
                reason, text = "stop", decoded[: min(hits)]
        if reason is None and (
            len(row.ids) >= job.max_tokens or len(job.prompt_ids) + len(row.ids) >= self.max_model_len
        ):
            reason = "length"
        if reason is None:
            return False
        job.results[row.choice] = SampleResult(
            token_ids=row.ids,
            logprobs=row.logprobs,
            top_logprobs=row.top,
            finish_reason=reason,
            text=text if text is not None else self.decode(text_ids),
        )
        if all(result is not None for result in job.results) and not job.future.done():
            job.future.set_result(job.results)
        return True

    def _stop_in_tail(self, ids: list[int], stops: list[str]) -> bool:
        """Cheap check: a stop string completed by the newest token lies in the last few tokens' text."""
        tail = self.decode(ids[-(4 * max(len(stop) for stop in stops) + 4) :])  # byte tokens: up to 4 a char
        return any(stop in tail for stop in stops)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

