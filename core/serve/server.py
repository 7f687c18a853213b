"""``tracerl serve``: one ``LocalBackend`` behind HTTP, so rollouts can run elsewhere (DESIGN §5.7).

Two surfaces on one port, so a laptop needs a single URL:

- ``/tracerl/v1/...``: the :class:`~tracerl.Backend` calls of :class:`~tracerl.RemoteBackend`
  (register, train, step, checkpoints, delete_checkpoints, leases) plus an unauthenticated ``health``;
- ``/v1/...``: the OpenAI routes rollouts use (``chat/completions`` streamed or not,
  ``completions``, ``models``), proxied to the inference server of the model named in the
  request.  Adapter loading is not exposed: ``train`` hot-loads the new step itself.

Every error is answered as ``{"error": {"type", "message", "param", "code"}}`` (OpenAI's shape,
with the Python exception type as ``type``) so clients can re-raise it, never as a bare 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TextIO

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field, ValidationError

from .. import __version__
from ..base_models import is_template_path
from ..errors import CheckpointError, ConfigError, MismatchError
from ..inference.gateway import ROLLOUT_HEADER, ROLLOUTS_PATH, GatewayMiddleware
from ..model import DEFAULT_BASE_PATH, TrainableModel
from ..net.http_server import key_matches, presented_key
from ..net.untraced import untraced_fastapi
from ..redact import register_secret
from ..timeouts import DEFAULT_INFERENCE_TIMEOUT, check_timeout, within
from .idempotency import DEFAULT_KEYS_PER_MODEL, IDEMPOTENCY_HEADER, TrainResults
from .leases import MAX_LEASES, HeldLeases, lease_seconds
from .middleware import DEFAULT_MAX_BODY_MB, AccessLog, BodyLimit, BodyTooLargeError
from .policy import ForbiddenError, ModelPolicy
from .remote_backend import API, decode_groups

if TYPE_CHECKING:  # pragma: no cover
    from ..model import Backend
    from ..tinker.service import TinkerService


log = logging.getLogger("tracerl.serve")


class ServeError(Exception):
    """An error with an explicit HTTP status and type name (auth, unknown model, bad upstream)."""

    def __init__(self, status: int, type_name: str, message: str) -> None:
        super().__init__(message)
        self.status, self.type_name, self.message = status, type_name, message


MAX_STALENESS = 8
"""The most staleness a client may announce: each step of it is one more LoRA slot in vLLM's memory."""


class RegisterRequest(BaseModel):
    """What is needed to recreate the client's ``TrainableModel`` here."""

    name: str
    project: str
    base_model: str
    lora_config: dict[str, Any] = Field(default_factory=dict)
    chat_template: str | None = None
    tool_call_parser: str | None = "auto"
    reasoning_parser: str | None = "auto"
    max_staleness: int | None = Field(None, ge=0, le=MAX_STALENESS)
    """A client's ``PipelineTrainer`` staleness (``LocalBackend.expect_staleness``): vLLM's LoRA slots; not part of
    the model's identity, so a later registration may announce another."""


def error_response(error: BaseException) -> JSONResponse:
    """The JSON answer for ``error``: 4xx for the caller's mistakes, 500 (logged with traceback) otherwise."""
    if isinstance(error, ServeError):
        status, type_name, message = error.status, error.type_name, error.message
    else:
        type_name, message = type(error).__name__, str(error)
        if isinstance(error, BodyTooLargeError):
            status = 413
        elif isinstance(error, ForbiddenError):
            status = 403
        elif isinstance(error, (TypeError, ValueError)):  # ConfigError, TrajectoryError, bad keywords
            status = 400
        elif isinstance(error, CheckpointError):
            status = 409
        elif isinstance(error, MismatchError):  # the step's groups disagree with the trainer: nothing was applied
            status = 422
        else:
            status = 500
            log.error("tracerl serve: unexpected %s", type_name, exc_info=error)
    body = {"error": {"type": type_name, "message": message, "param": None, "code": status}}
    return JSONResponse(body, status_code=status)


class _JSONErrorRoute(APIRoute):
    """Route class that turns any exception of an endpoint (dependencies included) into JSON."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as error:  # noqa: BLE001 - answered as JSON, logged when unexpected
                if type(error).__name__ == "RequestValidationError":
                    error = ServeError(400, "ValidationError", str(error))
                return error_response(error)

        return guarded


MAX_GATEWAYS = 10_000
"""Open rollout gateway tokens remembered (the oldest forgotten first; its close then gets a 404)."""


class _State:
    """The models served here (by name, as ``LocalBackend`` keys them), their train locks and recent train results."""

    def __init__(
        self, backend: Backend, base_path: Any, inference_timeout: float | None, keys_per_model: int = DEFAULT_KEYS_PER_MODEL
    ) -> None:
        self.backend = backend
        self.inference_timeout = inference_timeout
        self.results = TrainResults(keys_per_model)
        self.base_path = base_path
        self.models: dict[str, TrainableModel] = {}
        self.requested: dict[str, RegisterRequest] = {}  # as the client asked (base_model before the policy resolved it)
        self.locks: dict[str, asyncio.Lock] = {}
        self.register_lock = asyncio.Lock()
        self.gateways: OrderedDict[str, TrainableModel] = OrderedDict()
        """Open rollout gateway tokens -> the model whose inference server holds each (bounded)."""
        self._http: httpx.AsyncClient | None = None
        self.tinker: TinkerService | None = None
        self.leases = HeldLeases(backend)

    @property
    def http(self) -> httpx.AsyncClient:
        if self._http is None:  # created inside the serving loop
            # read/write/pool: a slow generation is fine, a hung inference server must not hold the caller forever
            self._http = httpx.AsyncClient(timeout=httpx.Timeout(self.inference_timeout, connect=10.0))
        return self._http

    def model(self, project: str, name: str) -> TrainableModel:
        model = self.models.get(name)
        if model is None or model.project != project:
            raise ServeError(404, "CheckpointError", f"model {project}/{name} is not registered here: register it first")
        return model

    def served(self) -> dict[str, TrainableModel]:
        return {n: m for n, m in self.models.items() if m.inference_base_url}

    def upstream(self, requested: Any) -> TrainableModel:
        """The model whose inference server (``inference_base_url``, ``inference_api_key``) serves
        ``requested`` (``"name@step"``, ``"name"``)."""
        served = self.served()
        if not served:
            raise ServeError(503, "InferenceServerError", "no model is being served here (register one; or the server runs with --inference none)")
        name = str(requested or "").split("@", 1)[0]
        if name in served:
            return served[name]
        if len({m.inference_base_url for m in served.values()}) == 1:  # one server: let it answer "base" or an unknown name itself
            return next(iter(served.values()))
        raise ServeError(404, "not_found_error", f"The model `{requested}` does not exist. Served: {sorted(served)}")

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        await self.leases.close()
        await self.backend.close()


def create_app(
    backend: Backend,
    *,
    token: str | None = None,
    base_path: Any = None,
    max_body_bytes: int = int(DEFAULT_MAX_BODY_MB * 2**20),
    policy: ModelPolicy | None = None,
    inference_timeout: float | None = DEFAULT_INFERENCE_TIMEOUT,
    access_log: TextIO | None = None,
    tinker: TinkerService | None = None,
) -> FastAPI:
    """The ``tracerl serve`` app around ``backend`` (closed when the app shuts down).

    ``token``: when set, every route but ``/tracerl/v1/health`` needs ``Authorization: Bearer <token>`` (or ``x-api-key``).
    ``max_body_bytes``: larger request bodies are answered 413 before they are read (one caller
    must not make the server buffer gigabytes).
    ``policy``: which base models, LoRA ranks and how many models clients may register (default
    :class:`~tracerl.serve.policy.ModelPolicy`: the embedded model only, rank <= 64, 4 models).
    ``inference_timeout``: seconds the ``/v1`` proxy waits for the inference server (between bytes
    of an answer); past it the caller gets a 504 ``InferenceTimeoutError``.
    ``access_log``: a text stream that gets one line per request (client, method, path, status,
    duration, bytes; never headers, query strings or bodies).
    ``tinker``: also speak the Tinker API (``/api/v1``, :mod:`tracerl.tinker.routes`), started
    with the app and closed with it; it takes the same ``token`` (as ``X-API-Key``).
    """
    token = token or None
    policy = policy or ModelPolicy()
    inference_timeout = check_timeout(inference_timeout, "inference_timeout")
    state = _State(backend, base_path or getattr(backend, "path", None) or DEFAULT_BASE_PATH, inference_timeout)
    state.tinker = tinker
    register_secret(token)  # never in this process's logs, spans or files (tracerl.redact)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if tinker is not None:
            await tinker.start()
        try:
            yield
        finally:
            if tinker is not None:
                await tinker.close()
            await state.close()

    async def authorize(request: Request) -> None:
        """The server's token, or (on ``/v1``) a Tinker tenant's key: ``request.state.tenant`` is then
        that tenant, who may sample only its own weights; without tenant keys the owner is the one tenant."""
        tenants = tinker is not None and tinker.keys is not None
        request.state.tenant = tinker.tenant_of(None) if tinker is not None and not tenants else None
        if token is None and not tenants or token is not None and key_matches(request.headers, token):
            return
        if tenants and request.url.path.startswith("/v1/"):
            request.state.tenant = tinker.tenant_of(presented_key(request.headers))  # type: ignore[union-attr]
            if request.state.tenant is not None:
                return
        raise ServeError(401, "Unauthorized", "missing or wrong token for tracerl serve (Authorization: Bearer, or x-api-key)")

    app = untraced_fastapi(title="tracerl serve", version=__version__, lifespan=lifespan)
    app.state.tracerl = state
    public = APIRouter(route_class=_JSONErrorRoute)
    router = APIRouter(route_class=_JSONErrorRoute, dependencies=[Depends(authorize)])

    @public.get(f"{API}/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "version": __version__}

    @router.post(f"{API}/models/register")
    async def register(request: Request) -> dict[str, Any]:
        try:
            wanted = RegisterRequest.model_validate(await _json(request))
        except ValidationError as error:
            raise ConfigError(f"bad register request: {error}") from error
        async with state.register_lock:
            model = state.models.get(wanted.name)
            if model is None:  # the server decides what it loads: refused before anything is started
                policy.check_count(len(state.models))
                base_model = policy.base_model(wanted.base_model)
                if wanted.chat_template is not None and is_template_path(wanted.chat_template):
                    raise ConfigError("chat_template must be sent as the template's text: this server reads no client-named files")
                model = TrainableModel(
                    wanted.name, wanted.project, base_model, lora_config=wanted.lora_config, base_path=state.base_path,
                    chat_template=wanted.chat_template, tool_call_parser=wanted.tool_call_parser, reasoning_parser=wanted.reasoning_parser,
                )  # fmt: skip
                policy.check_lora(model.lora_config)
                _expect_staleness(backend, model, wanted.max_staleness)  # before register: vLLM sizes its slots at start-up
                await backend.register(model)  # a failure releases what it started (LocalBackend.register)
                state.models[model.name] = model
                state.requested[model.name] = wanted
                state.locks[model.name] = asyncio.Lock()
            else:
                first = state.requested[wanted.name]
                if first.model_dump(exclude={"name", "max_staleness"}) != wanted.model_dump(exclude={"name", "max_staleness"}):
                    raise ConfigError(
                        f"model {wanted.name!r} is already served here for project {first.project!r}, base_model "
                        f"{first.base_model!r}, lora_config {first.lora_config}: use another name"
                    )
                _expect_staleness(backend, model, wanted.max_staleness)  # a vLLM already started: logged if too small
        step = await backend.get_step(model)
        return {
            "name": model.name,
            "project": model.project,
            "step": step,
            "inference_model_name": model.get_inference_name(step),
            "max_body_bytes": max_body_bytes,
        }

    @router.post(API + "/models/{project}/{name}/train")
    async def train(project: str, name: str, request: Request) -> Response:
        raw = await request.body()
        body = _parse_json(raw)
        kwargs = body.get("kwargs") or {}
        if not isinstance(kwargs, dict):
            raise ConfigError("'kwargs' must be a JSON object of train keyword arguments")
        model = state.model(project, name)
        inspect.signature(backend.train).bind(model, [], **kwargs)  # unknown keyword: TypeError before any work
        groups = decode_groups(body.get("groups"))

        async def step() -> dict[str, Any]:
            async with state.locks[name]:  # one step at a time per model; others queue
                result = await backend.train(model, groups, **kwargs)
            return {
                "step": result.step,
                "metrics": result.metrics,
                "checkpoint_path": result.checkpoint_path,
                "inference_model_name": model.get_inference_name(result.step),
            }

        # a retried call (same Idempotency-Key) gets the first call's answer, waiting for it if it still runs
        return _answer(await state.results.run(name, request.headers.get(IDEMPOTENCY_HEADER), raw, step))

    @router.post(API + "/models/{project}/{name}/train_sft")
    async def train_sft(project: str, name: str, request: Request) -> Response:
        """``backend.train_sft`` (tracerl.train.sft): Trajectory JSON and an ``SFTConfig`` dict (unknown key: TypeError)."""
        from ..train.sft_config import SFTConfig

        body = await _json(request)
        model = state.model(project, name)
        examples, val, settings = body.get("trajectories"), body.get("val_trajectories"), body.get("config")
        if not isinstance(examples, list) or not (val is None or isinstance(val, list)) or not (settings is None or isinstance(settings, dict)):
            raise ConfigError("'trajectories' (and 'val_trajectories') must be lists of trajectories, 'config' an SFTConfig object")
        config = SFTConfig.from_dict(settings)
        async with state.locks[name]:  # one step at a time per model, SFT or RL
            result = await backend.train_sft(model, examples, config, val_trajectories=val)
        return _answer(
            {
                "step": result.step,
                "metrics": result.metrics,
                "checkpoint_path": result.checkpoint_path,
                "inference_model_name": model.get_inference_name(result.step),
            }
        )

    @router.get(API + "/models/{project}/{name}/step")
    async def get_step(project: str, name: str) -> dict[str, Any]:
        return {"step": await backend.get_step(state.model(project, name))}

    @router.get(API + "/models/{project}/{name}/checkpoints")
    async def list_checkpoints(project: str, name: str) -> dict[str, Any]:
        return {"steps": await backend.list_checkpoints(state.model(project, name))}

    @router.get(API + "/models/{project}/{name}/step_records")
    async def step_records(project: str, name: str, after: int = 0) -> Response:
        """The committed steps' ``step.json`` records: a client killed between ``train`` and
        ``model.log`` recovers its missing history rows from them (``RemoteBackend.register``)."""
        model = state.model(project, name)
        return _answer({"records": await asyncio.to_thread(model.run_dir.step_records, after)})

    @router.post(API + "/models/{project}/{name}/delete_checkpoints")
    async def delete_checkpoints(project: str, name: str, request: Request) -> dict[str, Any]:
        keep = (await _json(request)).get("keep")
        if not isinstance(keep, list) or not all(isinstance(k, int) for k in keep):
            raise ConfigError("'keep' must be a list of checkpoint steps")
        model = state.model(project, name)
        async with state.locks[name]:
            return {"deleted": await backend.delete_checkpoints(model, keep=keep)}

    @router.post(API + "/models/{project}/{name}/leases")
    async def open_lease(project: str, name: str, request: Request) -> dict[str, Any]:
        """Keep ``name@step`` served while a client's rollouts that pinned it run (``RemoteBackend.policy_lease``)."""
        body = await _json(request)
        step = body.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"'step' must be a checkpoint step (an integer >= 0), got {step!r}")
        seconds = lease_seconds(body.get("seconds"))
        model = state.model(project, name)
        if not state.leases.supported:
            raise ServeError(501, "NotImplementedError", "this server's backend cannot lease a policy")
        if state.leases.full:
            raise ServeError(429, "TooManyLeasesError", f"{MAX_LEASES} policy leases are open here: release some first")
        return {"lease": await state.leases.open(model, step, seconds), "seconds": seconds}

    @router.delete(API + "/models/{project}/{name}/leases/{lease}")
    async def release_lease(project: str, name: str, lease: str) -> dict[str, Any]:
        if not await state.leases.release(state.model(project, name), lease):
            raise ServeError(404, "NotFoundError", f"no open lease {lease!r} on {project}/{name}: released already, or expired")
        return {"released": lease}

    @router.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        data: list[Any] = []
        by_url = {m.inference_base_url: m for m in state.served().values()}
        for url in sorted(by_url):
            call = state.http.get(f"{url}/models", headers=_upstream_headers(by_url[url]))
            response = await _upstream_call(call, state.inference_timeout)
            data += response.json().get("data", [])
        return {"object": "list", "data": data}

    @router.post(ROLLOUTS_PATH)
    async def open_gateway(request: Request) -> Response:
        """A rollout gateway token on the inference server of the model named in the body (``core/inference/gateway.py``)."""
        body = _parse_json(await request.body() or b"{}")
        model = state.upstream(body.get("model"))
        call = state.http.post(f"{model.inference_base_url}/tracerl/rollouts", headers=_upstream_headers(model))
        response = await _upstream_call(call, state.inference_timeout)
        if response.status_code == 200:
            state.gateways[response.json()["token"]] = model
            while len(state.gateways) > MAX_GATEWAYS:
                state.gateways.popitem(last=False)
        return Response(response.content, status_code=response.status_code, media_type="application/json")

    @router.delete(ROLLOUTS_PATH + "/{token}")
    async def close_gateway(token: str) -> Response:
        model = state.gateways.pop(token, None)
        if model is None:
            raise ServeError(404, "not_found_error", "unknown or finished rollout token: open a new one")
        call = state.http.delete(f"{model.inference_base_url}/tracerl/rollouts/{token}", headers=_upstream_headers(model))
        response = await _upstream_call(call, state.inference_timeout)
        return Response(response.content, status_code=response.status_code, media_type="application/json")

    for route in ("/chat/completions", "/completions", "/responses", "/messages"):  # OpenAI's, and Anthropic's Messages

        async def proxied(request: Request, route: str = route) -> Response:
            return await _proxy(state, request, route)

        router.add_api_route(f"/v1{route}", proxied, methods=["POST"], name=route.strip("/").replace("/", "_"))

    app.include_router(public)
    app.include_router(router)
    if tinker is not None:
        from ..tinker.routes import install

        install(app, tinker, token=token)
    app.add_middleware(GatewayMiddleware)  # /rollouts/{token}/v1/... is /v1/... with the rollout's header
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if access_log is not None:
        app.add_middleware(AccessLog, stream=access_log)  # added last, so outermost: it sees the 413s too
    return app


def _answer(body: dict[str, Any]) -> Response:
    """JSON that keeps NaN/inf metrics (Python's json reads them back); Starlette's JSONResponse would
    refuse them and turn a finished training step into an error."""
    return Response(json.dumps(body, default=str), media_type="application/json")


def _expect_staleness(backend: Backend, model: TrainableModel, max_staleness: int | None) -> None:
    """Pass a client pipeline's staleness on to a backend that sizes its serving by it (``LocalBackend``)."""
    expect = getattr(backend, "expect_staleness", None)
    if max_staleness is not None and expect is not None:
        expect(model, max_staleness)


async def _json(request: Request) -> dict[str, Any]:
    return _parse_json(await request.body())


def _parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except ValueError as error:
        raise ConfigError(f"the request body is not valid JSON: {error}") from error
    if not isinstance(body, dict):
        raise ConfigError("the request body must be a JSON object")
    return body


def _upstream_headers(model: TrainableModel) -> dict[str, str]:
    """The inference server's own per-process key (``LocalBackend`` set it on the model)."""
    return {"Authorization": f"Bearer {model.inference_api_key}"} if model.inference_api_key else {}


async def _upstream_call(call: Any, timeout: float | None) -> httpx.Response:
    try:
        return await call
    except httpx.ConnectTimeout as error:
        raise ServeError(502, "InferenceServerError", f"the inference server could not be reached: {error}") from error
    except httpx.TimeoutException as error:
        raise ServeError(
            504, "InferenceTimeoutError", f"the inference server did not answer {within(timeout)} (tracerl serve --inference-timeout)"
        ) from error
    except httpx.HTTPError as error:
        raise ServeError(502, "InferenceServerError", f"the inference server did not answer: {type(error).__name__}: {error}") from error


async def _proxy(state: _State, request: Request, route: str) -> Response:
    """Forward an OpenAI request to the model's server, streaming the answer (SSE or JSON) through."""
    content = await request.body()
    try:
        requested = json.loads(content).get("model")
    except (ValueError, AttributeError) as error:
        raise ServeError(400, "invalid_request_error", f"the request body is not a JSON object: {error}") from error
    tenant = request.state.tenant
    internal = None
    hold = contextlib.AsyncExitStack()  # a tenant's sampler weights stay loaded until the answer is relayed
    try:
        if state.tinker is not None and tenant is not None and isinstance(requested, str):
            internal = await state.tinker.openai_name(tenant, requested, hold)
        if internal is not None:  # weights a Tinker client saved for sampling, on the service's multi-LoRA server
            sampler = state.tinker.sampler  # type: ignore[union-attr]
            content = json.dumps({**json.loads(content), "model": internal}).encode()
            base_url, key = sampler.base_url, sampler.api_key
        elif tenant is not None and state.tinker is not None and state.tinker.keys is not None:
            raise ServeError(404, "not_found_error", f"The model `{requested}` is not one of your weights saved for sampling")
        else:
            model = state.upstream(requested)
            base_url, key = model.inference_base_url, model.inference_api_key
        headers = {"content-type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}  # the caller's own token stays here
        if request.headers.get(ROLLOUT_HEADER):
            headers[ROLLOUT_HEADER] = request.headers[ROLLOUT_HEADER]  # the call joins that rollout upstream
        outgoing = state.http.build_request("POST", f"{base_url}{route}", content=content, headers=headers)
        response = await _upstream_call(state.http.send(outgoing, stream=True), state.inference_timeout)
    except BaseException:
        await hold.aclose()
        raise
    return StreamingResponse(
        _relay(response, hold), status_code=response.status_code, media_type=response.headers.get("content-type", "application/json")
    )


async def _relay(response: httpx.Response, hold: contextlib.AsyncExitStack) -> AsyncIterator[bytes]:
    """Chunks as they come; the upstream response is closed (and ``hold`` released) even when the client goes away."""
    try:
        async for chunk in response.aiter_bytes():
            yield chunk
    finally:
        try:
            await response.aclose()
        finally:
            await hold.aclose()
