"""Spawn a child process with asyncio pipes, without running Python in the child before its exec.

uvloop's spawn (what `asyncio.create_subprocess_exec` is on a uvloop node) runs the at-fork
handlers of every library in the forked child. huggingface_hub registers one that takes its HTTP
pool's lock: when another thread held it, the child deadlocked before its exec, and uvloop, which
waits for the exec synchronously, froze the whole node. CPython's `subprocess` forks in C
(`_posixsubprocess`) and runs no Python in the child unless given a `preexec_fn`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import threading
from typing import IO


class ChildProcess:
    """A spawned child: its stdin as a StreamWriter, its stdout as a StreamReader, its exit code."""

    def __init__(self, popen: subprocess.Popen[bytes], stdin: asyncio.StreamWriter,
                 stdout: asyncio.StreamReader, exited: asyncio.Future[int]) -> None:
        self._popen = popen
        self.stdin = stdin
        self.stdout = stdout
        self._exited = exited

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        return self._exited.result() if self._exited.done() else None

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def kill(self) -> None:
        if not self._exited.done():
            with contextlib.suppress(ProcessLookupError):  # it exited since; the waiter thread reaps it
                self._popen.kill()


async def spawn(argv: list[str], env: dict[str, str], stderr: IO[bytes]) -> ChildProcess:
    """Start `argv` in a new session (Ctrl-C reaches the node, which stops its children itself).

    Its stdin and stdout are socket pairs, not pipes: uvloop closes a pipe's fd twice (libuv's
    close, then the file object's), and when another thread opened a file in between and got the
    same number, the second close took that one: a spawn failed with EBADF, or another thread's
    file vanished. A socket object uvloop detaches instead, so each fd is closed once."""
    loop = asyncio.get_running_loop()
    ours_in, theirs_in = socket.socketpair()
    ours_out, theirs_out = socket.socketpair()
    try:
        popen = await asyncio.to_thread(
            subprocess.Popen, argv, stdin=theirs_in.fileno(), stdout=theirs_out.fileno(), stderr=stderr,
            env=env, start_new_session=True, close_fds=True,
        )
    except BaseException:
        ours_in.close()
        ours_out.close()
        raise
    finally:
        theirs_in.close()  # the child has its own copies
        theirs_out.close()
    stdout = asyncio.StreamReader(loop=loop)  # asyncio's line limit, as create_subprocess_exec had
    await loop.create_unix_connection(lambda: _ReadToEnd(stdout, loop=loop), sock=ours_out)
    transport, protocol = await loop.create_unix_connection(
        lambda: asyncio.StreamReaderProtocol(asyncio.StreamReader(loop=loop), loop=loop), sock=ours_in)
    stdin = asyncio.StreamWriter(transport, protocol, None, loop)
    exited: asyncio.Future[int] = loop.create_future()
    exited.add_done_callback(lambda _: stdin.close())  # its pipe's fd is not kept past the child
    threading.Thread(target=_reap, args=(popen, loop, exited), name=f"reap-{popen.pid}", daemon=True).start()
    return ChildProcess(popen, stdin, stdout, exited)


class _ReadToEnd(asyncio.StreamReaderProtocol):
    """The child's stdout: at its end the transport closes the socket, as a pipe's would."""

    def eof_received(self) -> bool:
        super().eof_received()
        return False


def _reap(popen: subprocess.Popen[bytes], loop: asyncio.AbstractEventLoop, exited: asyncio.Future[int]) -> None:
    """Wait for the child on a thread of its own: the loop's executor is kept for short jobs."""
    code = popen.wait()
    with contextlib.suppress(RuntimeError):  # the loop closed first (the node is stopping)
        loop.call_soon_threadsafe(_settle, exited, code)


def _settle(exited: asyncio.Future[int], code: int) -> None:
    if not exited.done():
        exited.set_result(code)
