"""Planted secrets never leave: not in any exported byte, not in any written file.

A property test (hypothesis draws the keys: OpenAI/Anthropic/Langfuse/AWS/Google/HF/GitHub
shapes, bearer tokens, registered secrets of no known shape, and raw values that only ever
travel under a sensitive name).  Each example runs real rollouts that plant them through every
door at once:

- client ``api_key``, ``default_headers`` and per-call ``extra_headers`` of the OpenAI SDK,
  LiteLLM (``api_key``, ``extra_headers``) and LangChain's ``ChatOpenAI``, with OpenInference's
  OpenAI, LiteLLM and LangChain instrumentors running beside tracerl's hooks;
- a user message and the tool arguments and results that carry it;
- a real MCP server's tool results (a result that is the key, an error that echoes it);
- a real loopback HTTP server whose 401 and 500 answers echo the request's headers and body (a 401
  is handled by the agent; a 500 fails its rollout with ``InferenceServerError``);
- an exception raised in a rollout (it becomes an exception event and an ``ExceptionRecord``);
- tracerl's own log records (written to a file).

Then everything leaves: spans and scores to a real loopback Langfuse/OTLP collector (protobuf,
gzip, decoded as Langfuse does), ``model.log`` writes history and trajectories, the payload
``RemoteBackend`` would send is encoded.  Every byte is scanned for every planted value.
"""

from __future__ import annotations

import asyncio
import logging
import os
import string
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import pytest
from capture_fake_server import FakeOpenAIServer
from capture_helpers import openai_tool_agent
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from loopback_app import LoopbackApp
from mcp_http_server import McpHttpServer
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from otlp_collector import OTLPCollector
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import tracerl
import tracerl.integrations as ti
from tracerl.integrations import export
from tracerl.redact import REDACTED, register_secret
from tracerl.serve.remote_backend import dumps_body, encode_groups
from test_capture_mcp_http import streamable_http

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
pytest.importorskip("openinference.instrumentation.openai")
pytest.importorskip("openinference.instrumentation.litellm")
pytest.importorskip("openinference.instrumentation.langchain")
pytest.importorskip("mcp")

PK, SK = "pk-lf-test", "sk-lf-test"
ALNUM = string.ascii_letters + string.digits


class EchoingServer(LoopbackApp):
    """Answers ``/{status}/v1/chat/completions`` with that error status and a body that echoes the
    request's headers and body, as careless upstreams and proxies do."""

    def routes(self) -> list[Any]:
        return [Route("/{status:int}/v1/chat/completions", self._fail, methods=["POST"])]

    async def _fail(self, request: Request) -> JSONResponse:
        body = (await request.body()).decode(errors="replace")
        message = f"rejected: headers={dict(request.headers)} body={body}"
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error"}}, status_code=request.path_params["status"])

    def base_url(self, status: int) -> str:
        return f"http://127.0.0.1:{self.port}/{status}/v1"


@dataclass(frozen=True)
class Planted:
    api_key: str  # shaped: OpenAI client api_key (Authorization: Bearer ...)
    header: str  # raw: OpenAI client default header x-api-key
    extra_bearer: str  # token of a per-call extra_headers Authorization: Bearer ...
    litellm_key: str  # shaped: LiteLLM api_key
    litellm_bearer: str  # token of LiteLLM extra_headers Authorization (OpenInference records these)
    langchain_key: str  # shaped: ChatOpenAI api_key
    langchain_header: str  # raw: ChatOpenAI default header x-api-key
    user_key: str  # shaped: pasted into a user message -> tool arguments and results
    tool_secret: str  # registered: in a tool result the agent writes
    mcp_key: str  # shaped: an MCP tool returns it
    mcp_secret: str  # registered: an MCP tool error echoes it
    error_key: str  # shaped: api_key of calls whose 4xx/5xx bodies echo it
    error_header: str  # raw: x-api-key of those calls, echoed too
    exception_secret: str  # registered: in an exception a rollout raises
    log_key: str  # shaped: in a tracerl log record and its traceback


def _alnum(min_size: int = 32) -> st.SearchStrategy[str]:
    return st.text(alphabet=ALNUM, min_size=min_size, max_size=min_size + 16)


def shaped_keys() -> st.SearchStrategy[str]:
    return st.one_of(
        _alnum().map(lambda s: "sk-proj-" + s),
        _alnum().map(lambda s: "sk-ant-api03-" + s),
        _alnum().map(lambda s: "sk-" + s),
        st.uuids().map(lambda u: f"sk-lf-{u}"),
        st.uuids().map(lambda u: f"pk-lf-{u}"),
        st.text(alphabet=string.ascii_uppercase + string.digits, min_size=16, max_size=16).map(lambda s: "AKIA" + s),
        st.text(alphabet=ALNUM + "-_", min_size=35, max_size=35).map(lambda s: "AIza" + s),
        _alnum().map(lambda s: "hf_" + s),
        _alnum(36).map(lambda s: "ghp_" + s),
    )


def planted() -> st.SearchStrategy[Planted]:
    shaped, bearer = shaped_keys(), _alnum().map(lambda s: "tok-" + s)
    raw, registered = _alnum().map(lambda s: "raw" + s), _alnum().map(lambda s: "reg-" + s)
    kinds = {"header": raw, "langchain_header": raw, "error_header": raw, "extra_bearer": bearer, "litellm_bearer": bearer}
    kinds.update(dict.fromkeys(("tool_secret", "mcp_secret", "exception_secret"), registered))
    return st.builds(Planted, **{f.name: kinds.get(f.name, shaped) for f in fields(Planted)})


# -- the world the examples run in ---------------------------------------------------------------
@pytest.fixture(scope="module")
def world():
    from openinference.instrumentation.langchain import LangChainInstrumentor
    from openinference.instrumentation.litellm import LiteLLMInstrumentor
    from openinference.instrumentation.openai import OpenAIInstrumentor

    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        trace.set_tracer_provider(TracerProvider())
    provider = trace.get_tracer_provider()
    ti.instrument(tracer_provider=provider)
    instrumentors = [OpenAIInstrumentor(), LiteLLMInstrumentor(), LangChainInstrumentor()]
    for instrumentor in instrumentors:
        instrumentor.instrument(tracer_provider=provider)
    loop = asyncio.new_event_loop()
    with FakeOpenAIServer() as model, EchoingServer() as echo, OTLPCollector(PK, SK) as collector, McpHttpServer() as mcp:
        processor = ti.export_to_langfuse(collector.url, PK, SK, tracer_provider=provider)
        yield {"model": model, "echo": echo, "collector": collector, "mcp": mcp, "loop": loop, "processor": processor}
        processor.shutdown()
    loop.close()
    for instrumentor in instrumentors:
        instrumentor.uninstrument()


async def doors(keys: Planted, world: dict[str, Any]) -> None:
    """One rollout that plants every key through its door (errors are handled, as agents do)."""
    import litellm
    from langchain_openai import ChatOpenAI
    from mcp import ClientSession
    from openai import AsyncOpenAI

    model, echo = world["model"].base_url, world["echo"]
    client = AsyncOpenAI(base_url=model, api_key=keys.api_key, default_headers={"x-api-key": keys.header}, max_retries=0)
    await openai_tool_agent(client, f"my key is {keys.user_key}")
    await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], extra_headers={"Authorization": f"Bearer {keys.extra_bearer}"}
    )
    messages = [{"role": "user", "content": "look it up"}, {"role": "tool", "tool_call_id": "c1", "content": f"token={keys.tool_secret}"}]
    await client.chat.completions.create(model="m", messages=messages)
    await litellm.acompletion(
        model="hosted_vllm/m", base_url=model, api_key=keys.litellm_key, messages=[{"role": "user", "content": "lite"}],
        extra_headers={"Authorization": f"Bearer {keys.litellm_bearer}"},
    )  # fmt: skip
    chat = ChatOpenAI(model="m", base_url=model, api_key=keys.langchain_key, default_headers={"x-api-key": keys.langchain_header}, max_retries=0)
    await chat.ainvoke("langchain")
    await echoed_errors(keys, echo.base_url(401))  # the caller's mistake: the agent handles it, the rollout goes on
    async with streamable_http(world["mcp"].url) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        result = await session.call_tool("reverse", {"text": keys.mcp_key[::-1]})
        assert keys.mcp_key in result.content[0].text
        failed = await session.call_tool("fail", {"reason": f"password={keys.mcp_secret}"})
        assert keys.mcp_secret in failed.content[0].text


async def echoed_errors(keys: Planted, base_url: str) -> None:
    """Calls whose error answer echoes the key (OpenAI SDK and LiteLLM), handled by the agent."""
    import litellm
    from openai import AsyncOpenAI

    failing = AsyncOpenAI(base_url=base_url, api_key=keys.error_key, default_headers={"x-api-key": keys.error_header}, max_retries=0)
    with pytest.raises(Exception, match=keys.error_key):
        await failing.chat.completions.create(model="m", messages=[{"role": "user", "content": "fail"}])
    with pytest.raises(Exception, match=keys.error_key):
        await litellm.acompletion(
            model="hosted_vllm/m", base_url=base_url, api_key=keys.error_key, messages=[{"role": "user", "content": "x"}],
            extra_headers={"x-api-key": keys.error_header}, num_retries=0,
        )  # fmt: skip


async def failing_rollout(keys: Planted) -> None:
    raise RuntimeError(f"the tool could not authenticate with {keys.exception_secret}")


async def run_example(keys: Planted, world: dict[str, Any], directory: Path) -> tuple[list[tuple[str, bytes]], Any]:
    """Run the doors, let everything leave; every byte that left as (where, bytes), and the group."""
    collector = world["collector"]
    collector.bodies.clear()
    log_file = directory / "tracerl.log"
    handler = logging.FileHandler(log_file)
    logging.getLogger("tracerl").addHandler(handler)
    try:
        # a 5xx is the inference server's failure: that rollout becomes an exception (InferenceServerError)
        attempts = [doors(keys, world), echoed_errors(keys, world["echo"].base_url(500)), failing_rollout(keys)]
        group = await ti.trajectory_group(attempts, task="secrets")
        logging.getLogger("tracerl.integrations").warning(
            "probe: an upstream answered for key %s", keys.log_key, exc_info=ValueError(f"key {keys.log_key}")
        )
    finally:
        logging.getLogger("tracerl").removeHandler(handler)
        handler.close()
    model = tracerl.Model("agent", "secrets", base_path=directory)
    await model.log([group], split="train", step=1)
    assert world["processor"].force_flush(30_000)
    out = [(f"collector {i}", body) for i, body in enumerate(collector.bodies)]
    out.append(("RemoteBackend payload", dumps_body({"groups": encode_groups([group])})))
    out += [(str(p.relative_to(directory)), p.read_bytes()) for p in sorted(directory.rglob("*")) if p.is_file()]
    return out, group


def _check_the_doors_were_used(keys: Planted, group: tracerl.TrajectoryGroup, collector: OTLPCollector) -> None:
    """Positive controls: the keys really went through each door, and what left still says so."""
    assert len(group.trajectories) == 1, [(e.type, e.message[:300]) for e in group.exceptions]
    (trajectory,) = group.trajectories
    assert sorted(e.type for e in group.exceptions) == ["InferenceServerError", "RuntimeError"]
    assert all(REDACTED in e.message and REDACTED in e.traceback for e in group.exceptions)
    text = str(trajectory.model_dump())
    assert text.count(REDACTED) >= 4  # user key, its tool argument and result, MCP results
    spans = [s for s in collector.spans if s.trace_id == trajectory.trace_id]
    scopes = {s.scope for s in spans}
    assert {"tracerl.integrations", "openinference.instrumentation.openai", "openinference.instrumentation.litellm"} <= scopes
    assert "openinference.instrumentation.langchain" in scopes
    events = [attributes for s in collector.spans for name, attributes in s.events if name == "exception"]
    assert sum(REDACTED in str(e.get("exception.message")) for e in events) >= 4  # echoed 401/500 bodies, the raise
    chats = [s for s in spans if s.scope == "tracerl.integrations" and s.name.startswith("chat ")]
    assert chats and all("tracerl.input.base_span_id" not in s.attributes for s in chats)  # full inputs were exported


# No shrinking: the keys are independent of each other, and each example is seconds of real HTTP.
@settings(
    max_examples=5, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)  # fmt: skip
@given(keys=planted())
def test_planted_keys_never_leave(world, keys):
    register_secret(keys.tool_secret, keys.mcp_secret, keys.exception_secret)
    with tempfile.TemporaryDirectory() as directory:
        left, group = world["loop"].run_until_complete(run_example(keys, world, Path(directory)))
    found = [(where, name) for name, value in vars(keys).items() for where, data in left if value.encode() in data]
    assert found == []
    assert sum(len(data) for _, data in left) > 20_000 and len(left) >= 5  # spans, scores, files, payload all left
    _check_the_doors_were_used(keys, group, world["collector"])
