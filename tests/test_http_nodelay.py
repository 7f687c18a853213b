"""tracerl's in-process servers answer without Nagle's delay (``TCP_NODELAY`` on every accepted socket).

Sockets made with ``proto=0`` looked like non-TCP to asyncio, which then left Nagle on: every
keep-alive answer (headers and body written apart) waited for the client's delayed ACK, ~40 ms
per request on loopback through the router, the transformers server and the vLLM proxy.
"""

from __future__ import annotations

import asyncio
import socket

from tracerl.net.http_server import free_socket


async def test_accepted_connections_have_nagle_off():
    accepted: asyncio.Future = asyncio.get_running_loop().create_future()

    def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    sock = free_socket()
    assert sock.proto == socket.IPPROTO_TCP
    server = await asyncio.start_server(on_connect, sock=sock)
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        assert await accepted != 0
        writer.close()
    finally:
        server.close()
        await server.wait_closed()
