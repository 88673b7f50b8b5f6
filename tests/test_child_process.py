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
