"""A TCP proxy on loopback whose link the test can cut and heal: a network partition between one
process and a server, without root or network namespaces.

Cut: every open connection is closed and new ones are closed at once (the client sees the
server go away and keeps trying). Heal: connections are forwarded again.
"""

from __future__ import annotations

import asyncio
import threading


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self._target = (target_host, target_port)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._writers: set[asyncio.StreamWriter] = set()
        self._cut = False
        self.port = 0

    def start(self) -> TcpProxy:
        self._thread.start()
        server = asyncio.run_coroutine_threadsafe(asyncio.start_server(self._accept, "127.0.0.1", 0), self._loop).result()
        self._server = server
        self.port = server.sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def cut(self) -> None:
        def close_all() -> None:
            self._cut = True
            for writer in list(self._writers):
                writer.transport.abort()
            self._writers.clear()

        self._loop.call_soon_threadsafe(close_all)

    def heal(self) -> None:
        self._loop.call_soon_threadsafe(setattr, self, "_cut", False)

    def stop(self) -> None:
        self.cut()
        self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        if self._cut:
            client_writer.transport.abort()
            return
        try:
            server_reader, server_writer = await asyncio.open_connection(*self._target)
        except OSError:
            client_writer.transport.abort()
            return
        self._writers.update((client_writer, server_writer))
        await asyncio.gather(self._pipe(client_reader, server_writer), self._pipe(server_reader, client_writer))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                if self._cut:
                    break
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.transport.abort()
            self._writers.discard(writer)
