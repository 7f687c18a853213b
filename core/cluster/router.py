"""An OpenAI-compatible router in front of N inference replicas (vLLM or transformers servers).

Rollouts keep one URL (``router.base_url``) however many replicas serve behind it:

- each request goes to the replica with the fewest requests in flight, except that the requests
  of one group stay on the replica that served the group first (see :mod:`tracerl.cluster.pool`);
  the group is the ``x-tracerl-group`` header (``Model.openai_client()`` sends the id of the
  group gathering the rollout), else the request's ``user`` field, else a hash of the prompt up
  to its first user message (what a group's rollouts share), so any OpenAI client gets affinity;
- a replica that refuses the connection, drops it before answering or answers 502/503/504 is
  marked unhealthy and the request is retried on another one (``max_attempts``); a background
  check of every replica's ``/health`` brings it back.  With none left the answer is a 503 of
  type ``NoHealthyReplicaError`` (the same class :meth:`ReplicaPool.acquire` raises);
- answers are relayed chunk by chunk (``stream: true`` server-sent events pass straight through);
- every upstream call has a connect timeout and a request timeout (a 504 of type
  ``InferenceTimeoutError`` past it);
- ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` go to every replica, so the router
  is itself an :class:`~tracerl.inference.InferenceServer` (``load_adapter`` hot-loads
  ``name@step`` everywhere; the adapter path must be readable by each replica).

It is an asyncio app on uvicorn (the FastAPI app is in :mod:`tracerl.cluster.app`), so one router process handles thousands of concurrent
requests; ``python -m tracerl.cluster --replica URL --replica URL`` runs one standalone.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any, AsyncIterator, Callable, Sequence

import httpx

from ..errors import InferenceServerError, NoHealthyReplicaError
from ..net.http_server import KEEP_ALIVE_S  # noqa: F401 - re-exported: the router's idle-connection time
from ..timeouts import DEFAULT_INFERENCE_TIMEOUT, check_timeout, within
from .pool import Replica, ReplicaPool
from .routing import HOP_BY_HOP
from .upstream import AnswerDropped, Unreachable, Upstream, UpstreamTimeout

log = logging.getLogger("tracerl.router")

_RETRYABLE_STATUS = {502, 503, 504}
class Router:
    """Least-loaded, group-affine OpenAI router over ``replicas`` (base URLs, with or without ``/v1``)."""

    def __init__(
        self,
        replicas: Sequence[str],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        request_timeout: float | None = DEFAULT_INFERENCE_TIMEOUT,
        connect_timeout: float = 5.0,
        health_interval_s: float = 2.0,
        health_timeout_s: float = 5.0,
        max_attempts: int = 2,
        max_imbalance: int = 32,
        api_key: str | None = None,
        http: str = "auto",
        event_loop: str = "auto",
        keep_alive_s: float = KEEP_ALIVE_S,
    ) -> None:
        """``request_timeout``: seconds an upstream answer may take (None: no limit); ``max_attempts``:
        replicas tried per request; ``max_imbalance``: how much busier than the idlest replica a
        group's replica may be before a request of the group goes elsewhere; ``api_key``: the replicas'
        bearer key, sent on the router's own calls (``load_adapter``); clients' requests are
        forwarded with their own ``Authorization`` header; ``http``: uvicorn's HTTP parser (``auto``:
        httptools when installed, else h11); ``event_loop`` (``start`` only, ``serve`` runs in the
        caller's loop): ``auto`` is uvloop when installed, ``asyncio`` the standard loop.  Both fast
        ones come with the ``ray`` extra and cut the router's CPU per request (bench/RESULTS.md);
        ``keep_alive_s``: how long an idle client connection stays open (see ``KEEP_ALIVE_S``)."""
        self.keep_alive_s = check_timeout(keep_alive_s, "keep_alive_s")
        if http not in ("auto", "h11", "httptools") or event_loop not in ("auto", "asyncio", "uvloop"):
            raise InferenceServerError(f"http must be auto/h11/httptools and event_loop auto/asyncio/uvloop, got {http!r}, {event_loop!r}")
        self.http = http
        self.event_loop = event_loop
        self.pool = ReplicaPool(replicas, max_imbalance=max_imbalance)
        self.host = host
        self._port = port
        self.request_timeout = check_timeout(request_timeout, "request_timeout")
        self.connect_timeout = check_timeout(connect_timeout, "connect_timeout")
        self.health_interval_s = check_timeout(health_interval_s, "health_interval_s")
        self.health_timeout_s = check_timeout(health_timeout_s, "health_timeout_s")
        if max_attempts < 1:
            raise InferenceServerError(f"max_attempts must be >= 1, got {max_attempts}")
        self.max_attempts = max_attempts
        self.api_key = api_key
        self.base_url = ""
        self._http: Any = None  # BackgroundUvicorn
        self.upstream = Upstream(request_timeout=self.request_timeout, connect_timeout=self.connect_timeout)
        self._health_task: Any = None

    # --- InferenceServer -------------------------------------------------------------
    async def start(self) -> None:
        """Serve on a background thread (its own event loop) and start the health checks there."""
        from ..net.http_server import BackgroundUvicorn

        if self._http is not None and self._http.running:
            return
        from .app import build_app

        self._http = BackgroundUvicorn(build_app(self), host=self.host, port=self._port, name="tracerl-router",
                                       loop_factory=loop_factory(self.event_loop), http=self.http,
                                       keep_alive_s=self.keep_alive_s)
        port = await asyncio.to_thread(self._http.start)
        self.base_url = f"http://{self.host}:{port}/v1"
        self._health_task = asyncio.run_coroutine_threadsafe(self._health_loop(), self._http.loop)

    async def serve(self) -> None:
        """Serve in the current event loop until cancelled (the standalone ``python -m`` form)."""
        import uvicorn

        from ..net.http_server import free_socket
        from .app import build_app

        sock = free_socket(self.host, self._port)
        self.base_url = f"http://{self.host}:{sock.getsockname()[1]}/v1"
        server = uvicorn.Server(uvicorn.Config(build_app(self), log_level="warning", lifespan="off", access_log=False,
                                               http=self.http, timeout_keep_alive=self.keep_alive_s))
        health = asyncio.create_task(self._health_loop())
        try:
            await server.serve(sockets=[sock])
        finally:
            health.cancel()
            await self.upstream.close()

    async def load_adapter(self, name: str, path: str) -> None:
        """Hot-load the adapter folder ``path`` as ``name`` on every replica (through the router's fan-out)."""
        await self._own_call("/load_lora_adapter", {"lora_name": name, "lora_path": str(path), "load_inplace": True})

    async def unload_adapter(self, name: str) -> None:
        await self._own_call("/unload_lora_adapter", {"lora_name": name})

    async def health(self) -> bool:
        """True while the router runs and at least one replica is healthy."""
        return self._http is not None and self._http.running and bool(self.pool.healthy)

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            self._health_task = None
        if self._http is not None:
            loop = self._http.loop
            if loop is not None and loop.is_running():  # the session lives in the serving loop: closed there
                await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self.upstream.close(), loop))
            await asyncio.to_thread(self._http.stop)
            self._http = None

    # --- forwarding ------------------------------------------------------------------
    async def forward(self, method: str, path: str, headers: Any, content: bytes, key: str | None) -> tuple[Any, Replica]:
        """Send one request to a replica (retrying on another when one fails before answering); return
        the replica's answer with its status and headers read, its body not yet (:meth:`read`, :meth:`relay`)."""
        outgoing = [(k, v) for k, v in headers.items() if k.lower() not in HOP_BY_HOP]
        tried: list[str] = []
        last_error = ""
        for _attempt in range(self.max_attempts):
            try:
                replica = self.pool.acquire(key, exclude=tried)
            except NoHealthyReplicaError as error:
                if not tried:
                    raise
                raise NoHealthyReplicaError(f"{error} (last failure: {last_error})", replicas=error.replicas) from None
            try:
                response = await self.upstream.open(method, replica.url, path, outgoing, content)
            except UpstreamTimeout:
                self.pool.release(replica, error=f"no answer {within(self.request_timeout)}")
                raise
            except Unreachable as error:  # refused, connect timeout, closed before the headers
                last_error = self._failed(replica, tried, str(error))
                continue
            except BaseException:  # cancelled (the client left): the replica is free again
                self.pool.release(replica)
                raise
            if response.status in _RETRYABLE_STATUS:
                response.close()
                last_error = self._failed(replica, tried, f"answered {response.status}")
                continue
            return response, replica
        raise InferenceServerError(f"{len(tried)} replica(s) failed this request; last: {last_error}")

    def _failed(self, replica: Replica, tried: list[str], why: str) -> str:
        log.warning("replica %s failed a request (%s): marked unhealthy, trying another", replica.url, why)
        self.pool.release(replica, error=why)
        tried.append(replica.url)
        return f"{replica.url}: {why}"

    async def relay(self, response: Any, replica: Replica) -> AsyncIterator[bytes]:
        """The replica's answer chunk by chunk; the replica is released when it ends (or the client leaves)."""
        error = None
        try:
            async for chunk in self.upstream.chunks(response):
                yield chunk
        except AnswerDropped as failure:  # the replica died mid-answer: the client sees a cut connection
            error = str(failure)
            raise
        finally:
            response.release()
            self.pool.release(replica, error=error)

    async def read(self, response: Any, replica: Replica) -> bytes:
        """The replica's whole answer (not a stream); a cut answer (:class:`AnswerDropped`) marks the replica as :meth:`relay` does."""
        error = None
        try:
            return await self.upstream.body(response)
        except AnswerDropped as failure:
            error = str(failure)
            raise
        finally:
            self.pool.release(replica, error=error)

    async def broadcast(self, path: str, content: bytes, headers: Any) -> list[tuple[str, int, bytes]]:
        """POST to every replica (adapter loading); one failure does not stop the others."""
        outgoing = [(k, v) for k, v in headers.items() if k.lower() not in HOP_BY_HOP]

        async def one(replica: Replica) -> tuple[str, int, bytes]:
            try:
                status, body = await self.upstream.call("POST", replica.url + path, content=content, headers=outgoing)
                return replica.url, status, body
            except (Unreachable, UpstreamTimeout) as error:
                return replica.url, 502, str(error).encode()

        return list(await asyncio.gather(*(one(r) for r in self.pool.replicas)))

    # --- health ----------------------------------------------------------------------
    async def check_health(self) -> None:
        """GET every replica's ``/health`` once; 200 marks it healthy, anything else unhealthy."""

        async def one(replica: Replica) -> None:
            try:
                status, _ = await self.upstream.call("GET", replica.url + "/health", timeout=self.health_timeout_s)
                ok, why = status == 200, f"health check answered {status}"
            except Unreachable as error:
                ok, why = False, f"health check failed: {error}"
            if ok != replica.healthy:
                log.warning("replica %s is %s", replica.url, "healthy again" if ok else f"unhealthy ({why})")
            self.pool.mark(replica, healthy=ok, error=None if ok else why)

        await asyncio.gather(*(one(r) for r in self.pool.replicas))

    async def _health_loop(self) -> None:
        while True:
            try:
                await self.check_health()
            except Exception:  # noqa: BLE001 - the loop must outlive any one round
                log.exception("replica health check round failed")
            await asyncio.sleep(self.health_interval_s)

    async def _own_call(self, route: str, body: dict[str, Any]) -> None:
        if not self.base_url:
            raise InferenceServerError("the router is not started: call `await router.start()` first")
        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        async with httpx.AsyncClient(timeout=self.request_timeout) as client:
            answer = await client.post(self.base_url + route, json=body, headers=headers)
        if answer.status_code != 200:
            raise InferenceServerError(f"{route} failed on some replicas ({answer.status_code}): {answer.text[:2000]}")


def loop_factory(kind: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """The event-loop constructor for ``kind``: ``asyncio``, ``uvloop`` (must be installed) or ``auto``."""
    from ..net.http_server import fast_event_loop

    if kind == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return asyncio.new_event_loop if kind == "asyncio" else fast_event_loop


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m tracerl.cluster --replica URL [--replica URL ...] [--host H --port P]``."""
    p = argparse.ArgumentParser(description="OpenAI-compatible router over tracerl inference replicas")
    p.add_argument("--replica", action="append", required=True, help="a replica's base URL (repeat)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--request-timeout", type=float, default=DEFAULT_INFERENCE_TIMEOUT)
    p.add_argument("--health-interval", type=float, default=2.0)
    p.add_argument("--http", choices=["auto", "h11", "httptools"], default="auto", help="auto: httptools when installed")
    p.add_argument("--loop", choices=["auto", "asyncio", "uvloop"], default="auto", help="auto: uvloop when installed")
    args = p.parse_args(argv)
    router = Router(args.replica, host=args.host, port=args.port, request_timeout=args.request_timeout,
                    health_interval_s=args.health_interval, http=args.http, event_loop=args.loop)
    print(f"tracerl router on http://{args.host}:{args.port}/v1 over {len(args.replica)} replicas", flush=True)
    with asyncio.Runner(loop_factory=loop_factory(args.loop)) as runner:
        runner.run(router.serve())


if __name__ == "__main__":
    main()
