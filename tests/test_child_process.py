"""Runners are spawned without running Python in the forked child (exo/worker/child_process.py).

The bug this guards: on a uvloop node, spawning a runner ran huggingface_hub's at-fork handler in
the child; it took a lock another thread held, the child hung before its exec, and uvloop, waiting
for that exec synchronously, froze the node. The scenario runs in a helper process, because the
broken spawn freezes the event loop that would have timed it out.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

SPAWN_UNDER_A_HELD_AT_FORK_LOCK = textwrap.dedent("""
    import asyncio, os, sys, threading, time
    import uvloop
    from exo.worker.child_process import spawn

    held = threading.Lock()
    # Like huggingface_hub's close_session: an after-fork handler that takes a lock. The timeout
    # only keeps a broken run from leaving a stuck child behind.
    os.register_at_fork(after_in_child=lambda: held.acquire(timeout=20))

    async def main():
        held.acquire()  # a thread of the parent holds it while the runner is spawned
        began = time.monotonic()
        echo = "import sys; sys.stdout.write(sys.stdin.readline())"
        with open(os.devnull, "wb") as stderr:
            child = await spawn([sys.executable, "-c", echo], dict(os.environ), stderr)
        child.stdin.write(b"hello\\n")
        await child.stdin.drain()
        line = await child.stdout.readline()
        code = await child.wait()
        print(line.decode().strip(), code, round(time.monotonic() - began, 2))

    uvloop.run(main())
""")


def test_spawn_runs_no_at_fork_handler_in_the_child() -> None:
    done = subprocess.run([sys.executable, "-c", SPAWN_UNDER_A_HELD_AT_FORK_LOCK],
                          capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    echoed, code, seconds = done.stdout.split()
    assert (echoed, code) == ("hello", "0")
    assert float(seconds) < 10  # the broken spawn waits out the handler's 20 s lock timeout


KILLED_CHILD = textwrap.dedent("""
    import asyncio, os, signal, sys
    import uvloop
    from exo.worker.child_process import spawn

    async def main():
        with open(os.devnull, "wb") as stderr:
            child = await spawn([sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ), stderr)
        assert child.returncode is None
        child.kill()
        code = await asyncio.wait_for(child.wait(), 10)
        assert child.returncode == code == -signal.SIGKILL, code
        assert await child.stdout.read() == b""  # its stdout ends with it
        try:  # its stdin is closed with it: a request to a dead runner fails, it does not hang
            child.stdin.write(b"x\\n")
            await asyncio.wait_for(child.stdin.drain(), 10)
        except (ConnectionError, RuntimeError) as error:
            print("refused", type(error).__name__)

    uvloop.run(main())
""")


def test_a_killed_child_is_reaped_and_its_pipes_close() -> None:
    done = subprocess.run([sys.executable, "-c", KILLED_CHILD], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("refused"), done.stdout


SPAWNS_BESIDE_THREADS_OPENING_FILES = textwrap.dedent("""
    import asyncio, os, sys, threading
    import uvloop
    from exo.worker.child_process import spawn

    errors, done = [], threading.Event()

    def open_and_close():  # another thread's files, as a node's to_thread work has them
        while not done.is_set():
            read, write = os.pipe()
            try:
                os.write(write, b"x")
                assert os.read(read, 1) == b"x"
            except (OSError, AssertionError) as error:
                errors.append(repr(error))
            for fd in (read, write):
                try:
                    os.close(fd)
                except OSError as error:  # closed already: by another's second close of the number
                    errors.append(repr(error))

    async def echo_once():
        try:
            child = await spawn(["cat"], dict(os.environ), sys.stderr.buffer)
            child.stdin.write(b"hello\\n")
            await child.stdin.drain()
            if await child.stdout.readline() != b"hello\\n":
                errors.append("a child's line was lost")
            child.kill()
            await child.wait()
        except OSError as error:
            errors.append(repr(error))

    async def main():
        await echo_once()  # the loop's own fds (uvloop keeps one on /dev/null) opened before counting
        fds = len(os.listdir("/proc/self/fd"))
        threads = [threading.Thread(target=open_and_close) for _ in range(2)]
        for thread in threads:
            thread.start()
        for _ in range(100):
            await asyncio.gather(*(echo_once() for _ in range(4)))
        done.set()
        for thread in threads:
            thread.join()
        await asyncio.sleep(0.5)  # the last children's sockets close once their ends are read
        print(len(errors), len(os.listdir("/proc/self/fd")) - fds, errors[:3])

    uvloop.run(main())
""")


def test_children_s_fds_are_closed_once_so_no_other_thread_loses_a_file() -> None:
    # uvloop closes a pipe transport's fd twice (libuv, then the file object): a number another
    # thread got in between was closed under it (a spawn failed with EBADF: test_partition, once).
    done = subprocess.run([sys.executable, "-c", SPAWNS_BESIDE_THREADS_OPENING_FILES],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    errors, leaked, first = done.stdout.split(" ", 2)
    assert (errors, leaked) == ("0", "0"), first  # with pipes: about 5% of the spawns failed or closed another's fd
