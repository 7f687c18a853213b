"""The Tinker API's HTTP routes (``/api/v1/...``), as the official ``tinker`` SDK calls them.

Requests are validated with the SDK's own pydantic types and answered in the shapes it
reads; ``forward_backward`` and sampling results are protobuf (:mod:`tracerl.tinker.wire`).
Long operations answer ``{"request_id"}`` at once; the SDK polls ``retrieve_future``, held
open up to the service's long-poll window, then ``try_again``.  Failures inside a future
come back as ``{"error", "category"}`` (the SDK's ``RequestFailedError``); a bad request
before it is queued as 400 ``{"detail"}`` (``BadRequestError``), an unknown id — or another
tenant's, answered the same — as 404, a wrong key as 401 (``AuthenticationError``), a full
queue or table as 429 with ``Retry-After`` (the SDK waits and resubmits).  Every route but
``healthz`` needs the server's key in ``X-API-Key`` (the SDK's header; keys start with ``tml-``).
``GET /api/v1/tracerl/stats`` (tracerl's own) gives the limits, the caller's counts and the
sampler's adapter counts; ``GET /api/v1/tracerl/usage`` the caller's usage (tokens trained and
sampled, compute seconds) and disk against its quota, which ``list_checkpoints`` also answers
beside each checkpoint's ``size_bytes``.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from tinker import types
from tinker.types.try_again_response import TryAgainResponse

from ..errors import ConfigError, TracerlError
from ..net.http_server import key_matches
from .fair_queue import QueueFullError
from .lora_pool import AdapterSpec
from .service import Forbidden, Gone, NotFound, Result, TinkerService
from .wire import PROTOBUF, read_forward_backward

API = "/api/v1"
ADAM_KEYS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")


class HTTPFailure(Exception):
    def __init__(self, status: int, detail: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status, self.detail, self.headers = status, detail, headers


def install(app: FastAPI, service: TinkerService, *, token: str | None) -> None:
    """Add the Tinker routes to ``app`` (``tracerl serve``), keyed by ``token``."""

    async def authorize(request: Request) -> None:
        if service.keys is None and token is not None and not key_matches(request.headers, token):
            raise HTTPFailure(401, "missing or wrong API key (X-API-Key: the key tracerl serve was started with)")
        if service.tenant_of(request.headers.get("x-api-key")) is None:
            raise HTTPFailure(401, "missing or unknown API key (X-API-Key: a tenant key of this server)")

    def tenant(request: Request) -> str:
        return service.tenant_of(request.headers.get("x-api-key")) or ""

    app.add_exception_handler(HTTPFailure, _failure_response)  # type: ignore[arg-type]
    public = APIRouter()
    router = APIRouter(dependencies=[Depends(authorize)])

    @public.get(f"{API}/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @router.post(f"{API}/client/config")
    async def client_config() -> dict[str, Any]:
        return {}  # the SDK's defaults: plain protobuf bodies, per-request polling

    @router.post(f"{API}/client/dynamic_config")
    async def dynamic_config() -> dict[str, Any]:
        return types.ClientDynamicConfigResponse().model_dump(mode="json")

    @router.get(f"{API}/get_server_capabilities")
    async def capabilities() -> dict[str, Any]:
        offered = types.SupportedModel(model_name=service.model_name, max_context_length=service.max_context_length, trainable=True, sampleable=True)
        return types.GetServerCapabilitiesResponse(supported_models=[offered]).model_dump(mode="json")

    @router.get(f"{API}/tracerl/stats")
    async def stats(who: str = Depends(tenant)) -> dict[str, Any]:
        return service.stats(who)

    @router.get(f"{API}/tracerl/usage")
    async def usage(who: str = Depends(tenant)) -> dict[str, Any]:
        """The caller's usage (tokens trained, sampled, compute seconds) and disk against its quota."""
        return {"tenant": who, "usage": service.usage.of(who), "disk": service.disk(who)}

    @router.post(f"{API}/telemetry")
    async def telemetry() -> dict[str, str]:
        return {"status": "accepted"}

    # -- sessions -------------------------------------------------------------------
    @router.post(f"{API}/create_session")
    async def create_session(request: Request, who: str = Depends(tenant)) -> dict[str, Any]:
        body = await _read(request, types.CreateSessionRequest)
        return {"session_id": call(service.create_session, who, body.user_metadata)}

    @router.post(f"{API}/session_heartbeat")
    async def heartbeat(request: Request, who: str = Depends(tenant)) -> dict[str, Any]:
        call(service.heartbeat, who, (await _read(request, types.SessionHeartbeatRequest)).session_id)
        return {"type": "session_heartbeat"}

    @router.post(API + "/sessions/{session_id}/finish")
    async def finish(session_id: str, who: str = Depends(tenant)) -> dict[str, Any]:
        call(service.finish, who, session_id)
        return {}

    # -- futures ----------------------------------------------------------------------
    @router.post(f"{API}/retrieve_future")
    async def retrieve_future(request: Request, who: str = Depends(tenant)) -> Response:
        request_id = (await _read(request, types.FutureRetrieveRequest)).request_id
        result = await _awaited(service.wait(who, request_id))
        if result is None:
            return JSONResponse(TryAgainResponse(request_id=request_id, queue_state="active").model_dump(mode="json"))
        if result.error is not None:
            message, category = result.error
            return JSONResponse({"error": message, "category": category})
        if isinstance(result.payload, bytes):
            return Response(result.payload, media_type=PROTOBUF)
        return JSONResponse(result.payload)

    # -- training ---------------------------------------------------------------------
    @router.post(f"{API}/create_model")
    async def create_model(request: Request, who: str = Depends(tenant)) -> dict[str, Any]:
        body = await _read(request, types.CreateModelRequest)
        lora = body.lora_config or types.LoraConfig(rank=32)
        spec = call(AdapterSpec, lora.rank, lora.seed, lora.train_mlp, lora.train_attn, lora.train_unembed)
        model_id, result = call(service.create_model, who, body.session_id, body.model_seq_id, body.base_model, spec, body.user_metadata)
        return _future(result, model_id)

    @router.post(f"{API}/get_info")
    async def get_info(request: Request, who: str = Depends(tenant)) -> dict[str, Any]:
        run = call(service.run_of, who, (await _read(request, types.GetInfoRequest)).model_id)
        data = types.ModelData(arch="llama", model_name=run.base_model, tokenizer_id=str(service.model_path))
        return types.GetInfoResponse(
            type="get_info", model_id=run.model_id, model_data=data, is_lora=True, lora_rank=run.spec.rank, model_name=run.base_model
        ).model_dump(mode="json")

    @router.post(f"{API}/forward_backward")
    async def forward_backward(request: Request, who: str = Depends(tenant)) -> dict[str, Any]:
        parsed = call(read_forward_backward, await request.body(), request.headers.get("content-encoding"))
        return _future(call(service.forward_backward, who, parsed), parsed.model_id)

    @router.post(f"{API}/optim_step")
    async def optim_step(request: Request, who: str = Depends(tenant)) -> dict[str, Any]:
        body = await _read(request, types.OptimStepRequest)
        params = body.optim_params.model_dump()
        if not isinstance(body.optim_params, types.AdamParams):
            raise HTTPFailure(400, f"this server's optimizer is Adam; got {params.get('type')!r} parameters")
        adam = {key: float(params[key]) for key in ADAM_KEYS}
        return _future(call(service.optim_step, who, body.model_id, body.seq_id, adam), body.model_id)

    @router.post(f"{API}/save_weights")
    async def save_weights(request: Request, who: str = Depends(tenant)) -> dict[str, Any]:
        body = await _read(request, types.SaveWeightsRequest)
        return _future(call(service.save_state, who, body.model_id, body.seq_id, body.path), body.model_id)

    @router.post(f"{API}/save_weights_for_sampler")
    async def save_for_sampler(request: Request, who: str = Depends(tenant)) -> dict[str, Any]:
        body = await _read(request, types.SaveWeightsForSamplerRequest)
        result = call(service.save_for_sampler, who, body.model_id, body.seq_id, body.path, body.sampling_session_seq_id)
        return _future(result, body.model_id)

    @router.post(f"{API}/load_weights")
    async def load_weights(request: Request, who: str = Depends(tenant)) -> dict[str, Any]:
        body = await _read(request, types.LoadWeightsRequest)
        if body.session_id is not None:  # create_training_client_from_state: a new run, its seq 0
            model_id, result = call(service.create_from_checkpoint, who, body.session_id, body.model_seq_id, body.path, body.optimizer, body.user_metadata)
            return _future(result, model_id)
        return _future(call(service.load_state, who, body.model_id, body.seq_id, body.path, body.optimizer), body.model_id)

    # -- sampling ---------------------------------------------------------------------
    @router.post(f"{API}/create_sampling_session")
    async def create_sampling_session(request: Request, who: str = Depends(tenant)) -> dict[str, Any]:
        body = await _read(request, types.CreateSamplingSessionRequest)
        sampling_id = call(service.create_sampling_session, who, body.session_id, body.sampling_session_seq_id, body.model_path, body.base_model)
        return {"sampling_session_id": sampling_id}

    @router.get(API + "/samplers/{sampling_id}")
    async def sampler(sampling_id: str, who: str = Depends(tenant)) -> dict[str, Any]:
        session = call(service.sampling_session, who, sampling_id)
        return {"sampler_id": sampling_id, "base_model": session.base_model, "model_path": session.model_path}

    @router.post(f"{API}/asample")
    async def asample(request: Request, who: str = Depends(tenant)) -> dict[str, Any]:
        body = await _read(request, types.SampleRequest)
        if body.sampling_session_id is None or body.seq_id is None:
            raise HTTPFailure(400, "sample through a sampling session (ServiceClient.create_sampling_client)")
        unsupported = [name for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k") if getattr(body, name)]
        if unsupported or body.target_prompt_logprobs is not None or body.prompt_logprobs_last_n is not None:
            raise HTTPFailure(400, f"this server does not offer {unsupported or 'target/last-n prompt logprobs'}")
        params = body.sampling_params.model_dump()
        result = call(service.sample, who, body.sampling_session_id, body.seq_id, body.prompt.to_ints(), body.num_samples, params, bool(body.prompt_logprobs))
        return {**_future(result), "sample_sequence_ids": [f"{result.request_id}:{i}" for i in range(body.num_samples)]}

    # -- training runs and checkpoints (RestClient) -------------------------------------------
    def run_json(who: str, model_id: str) -> dict[str, Any]:
        run = call(service.run_of, who, model_id)
        return types.TrainingRun(
            training_run_id=model_id, base_model=run.base_model, model_owner="tracerl", is_lora=True,
            lora_rank=run.spec.rank, last_request_time=run.last_request_time or "", user_metadata=run.user_metadata,
        ).model_dump(mode="json")  # fmt: skip

    @router.get(f"{API}/training_runs")
    async def training_runs(limit: int = 20, offset: int = 0, who: str = Depends(tenant)) -> dict[str, Any]:
        ids = [run.model_id for run in service.runs_of(who)]
        page = [run_json(who, model_id) for model_id in ids[offset : offset + limit]]
        return {"training_runs": page, "cursor": {"offset": offset, "limit": limit, "total_count": len(ids)}}

    @router.get(API + "/training_runs/{model_id}")
    async def training_run(model_id: str, who: str = Depends(tenant)) -> dict[str, Any]:
        return run_json(who, model_id)

    @router.get(API + "/training_runs/{model_id}/checkpoints")
    async def checkpoints(model_id: str, who: str = Depends(tenant)) -> dict[str, Any]:
        listed = call(service.checkpoints, who, model_id)  # each with its size_bytes
        return {"checkpoints": listed, "disk": service.disk(who)}  # and the tenant's use of its disk quota

    @router.delete(API + "/training_runs/{model_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(model_id: str, checkpoint_id: str, who: str = Depends(tenant)) -> Response:
        await _awaited(service.delete_checkpoint(who, model_id, checkpoint_id))
        return Response(status_code=204)

    app.include_router(public)
    app.include_router(router)


def call(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` with the service's errors as HTTP answers the SDK turns into its exceptions."""
    try:
        return function(*args)
    except Exception as error:
        raise _translated(error) from error


async def _awaited(awaitable: Awaitable[Any]) -> Any:
    try:
        return await awaitable
    except Exception as error:
        raise _translated(error) from error


def _translated(error: Exception) -> Exception:
    if isinstance(error, NotFound):
        return HTTPFailure(404, str(error))
    if isinstance(error, Gone):
        return HTTPFailure(410, str(error))
    if isinstance(error, Forbidden):
        return HTTPFailure(403, str(error))
    if isinstance(error, QueueFullError):
        return HTTPFailure(429, str(error), {"Retry-After": str(max(1, math.ceil(error.retry_after)))})
    if isinstance(error, (ConfigError, TracerlError, ValueError, TypeError)):
        return HTTPFailure(400, f"{type(error).__name__}: {error}")
    return error


async def _read(request: Request, model: type[BaseModel]) -> Any:
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as error:
        raise HTTPFailure(400, f"not a valid {model.__name__}: {error}") from error


def _future(result: Result, model_id: str | None = None) -> dict[str, Any]:
    return types.UntypedAPIFuture(request_id=result.request_id, model_id=model_id).model_dump(mode="json", exclude_none=True)


async def _failure_response(_request: Request, failure: HTTPFailure) -> JSONResponse:
    return JSONResponse({"detail": failure.detail}, status_code=failure.status, headers=failure.headers)
