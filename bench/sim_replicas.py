"""Simulated inference replicas for ``bench/scale_sim.py``: asyncio HTTP servers that decode on a clock.

Each replica answers ``POST /v1/chat/completions`` (OpenAI shape, with ``token_ids``,
``prompt_token_ids`` and logprobs as tracerl's servers return them) and ``GET /health``.  Its
"engine" is continuous batching under processor sharing: every tick, each request in flight
gets one token; a tick lasts ``1 / per_request_rate(c)`` seconds for ``c`` requests in flight,
where the aggregate rate grows linearly up to ``knee`` concurrent requests and stays flat
after (``rate_at_knee`` tokens/s).  The default numbers are this machine's measured vLLM
decode speed: 101 tokens/s base model at 8 concurrent requests (REFERENCE §7).

Ticks run on an ideal schedule (``t0 + sum of tick lengths``), and each answer carries
``tracerl_sim.engine_s`` = its finishing tick's ideal time − its arrival.  A replica process
that lags (a busy CPU) therefore answers later than its engine time, and that lag is counted
as orchestration overhead, never hidden inside the simulated latency.

    python bench/sim_replicas.py --replicas 8      # prints "PORTS p1 p2 ..." and serves until killed
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Job:
    remaining: int
    arrived: float
    done: asyncio.Future
    tokens: int = 0


@dataclass
class Engine:
    rate_at_knee: float = 101.0
    knee: int = 8
    active: list[_Job] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    served: int = 0

    def per_request_rate(self, concurrent: int) -> float:
        aggregate = self.rate_at_knee * min(concurrent, self.knee) / self.knee
        return aggregate / concurrent

    async def generate(self, tokens: int) -> float:
        """Wait until ``tokens`` are decoded; return the engine time (ideal finishing tick − arrival)."""
        job = _Job(remaining=max(tokens, 1), arrived=time.monotonic(), done=asyncio.get_running_loop().create_future())
        self.active.append(job)
        self.wake.set()
        return await job.done

    async def run(self) -> None:
        ideal = time.monotonic()
        while True:
            if not self.active:
                self.wake.clear()
                await self.wake.wait()
                ideal = time.monotonic()  # an idle engine starts its next tick when work arrives
            ideal += 1.0 / self.per_request_rate(len(self.active))
            delay = ideal - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            still = []
            for job in self.active:
                job.remaining -= 1
                job.tokens += 1
                if job.remaining <= 0:
                    self.served += 1
                    job.done.set_result(max(ideal - job.arrived, 0.0))
                else:
                    still.append(job)
            self.active = still


@functools.lru_cache(maxsize=4096)
def _choice_json(tokens: int, logprobs: bool, token_ids: bool) -> str:
    """A choice of ``tokens`` tokens, serialised once per shape: the simulator's own CPU per answer stays
    small next to what it simulates (a deployment's replicas run on their own machines)."""
    ids = [(i * 104_729) % 49_000 + 100 for i in range(tokens)]
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length",
                              "message": {"role": "assistant", "content": " ".join(f"t{t}" for t in ids)}}
    if logprobs:
        choice["logprobs"] = {"content": [{"token": f"t{t}", "logprob": -1.0, "bytes": None, "top_logprobs": []} for t in ids]}
    if token_ids:
        choice["token_ids"] = ids
    return json.dumps(choice)


@functools.lru_cache(maxsize=4096)
def _prompt_ids_json(n: int) -> str:
    return json.dumps([(i * 7919) % 49_000 + 100 for i in range(n)])


def completion(body: dict[str, Any], tokens: int, engine_s: float) -> bytes:
    """The OpenAI chat completion answer (JSON bytes) for ``body``, ``tokens`` long, with its engine time."""
    prompt_chars = sum(len(str(m.get("content") or "")) for m in body.get("messages") or [])
    prompt_n = max(prompt_chars // 4, 1)
    return_ids = bool(body.get("return_token_ids"))
    head = json.dumps({"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                       "model": body.get("model", "sim"),
                       "usage": {"prompt_tokens": prompt_n, "completion_tokens": tokens, "total_tokens": prompt_n + tokens},
                       "tracerl_sim": {"engine_s": engine_s}})
    tail = f', "choices": [{_choice_json(tokens, bool(body.get("logprobs")), return_ids)}]'
    if return_ids:
        tail += f', "prompt_token_ids": {_prompt_ids_json(prompt_n)}'
    return (head[:-1] + tail + "}").encode()


async def _serve_connection(engine: Engine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """HTTP/1.1 with keep-alive: the minimum httpx (the router's client) speaks."""
    try:
        while True:
            line = await reader.readline()
            if not line:
                return
            method, path, _ = line.decode().split(" ", 2)
            headers = {}
            while (header := await reader.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = header.decode().partition(":")
                headers[name.strip().lower()] = value.strip()
            body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
            if method == "GET" and path == "/health":
                status, data = 200, json.dumps({"status": "ok", "active": len(engine.active)}).encode()
            elif method == "POST" and path == "/v1/chat/completions":
                request = json.loads(body)
                tokens = int(request.get("max_tokens") or request.get("max_completion_tokens") or 64)
                engine_s = await engine.generate(tokens)
                status, data = 200, completion(request, tokens, engine_s)
            else:
                status, data = 404, json.dumps({"error": {"message": f"no route {method} {path}", "type": "not_found_error"}}).encode()
            writer.write(f"HTTP/1.1 {status} {'OK' if status == 200 else 'Not Found'}\r\ncontent-type: application/json\r\n"
                         f"content-length: {len(data)}\r\n\r\n".encode() + data)
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError, ValueError):
        return
    finally:
        writer.close()


async def serve(replicas: int, rate_at_knee: float, knee: int) -> None:
    servers, ports, tasks = [], [], []
    for _ in range(replicas):
        engine = Engine(rate_at_knee=rate_at_knee, knee=knee)
        tasks.append(asyncio.create_task(engine.run()))
        server = await asyncio.start_server(lambda r, w, e=engine: _serve_connection(e, r, w), "127.0.0.1", 0, backlog=4096)
        servers.append(server)
        ports.append(server.sockets[0].getsockname()[1])
    print("PORTS " + " ".join(map(str, ports)), flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--rate-at-knee", type=float, default=101.0, help="aggregate decode tokens/s at --knee concurrent")
    p.add_argument("--knee", type=int, default=8)
    p.add_argument("--loop", choices=["auto", "asyncio", "uvloop"], default="auto",
                   help="auto: uvloop when installed (less of the simulator's own CPU per answer)")
    args = p.parse_args()
    loop_factory = asyncio.new_event_loop
    if args.loop != "asyncio":
        try:
            import uvloop

            loop_factory = uvloop.new_event_loop
        except ImportError:
            if args.loop == "uvloop":
                raise
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(serve(args.replicas, args.rate_at_knee, args.knee))


if __name__ == "__main__":
    main()
