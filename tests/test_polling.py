"""The harness's one polling helper (tests/support/polling.py) and the names tests import it by."""

import httpx
import pytest

from tests.conftest import eventually as conftest_eventually
from tests.support import cluster, healing, polling


def answers(*values: object):
    """A predicate that returns `values` one per call, then the last one forever; counts its calls."""
    calls: list[object] = []

    def predicate() -> object:
        calls.append(None)
        value = values[min(len(calls), len(values)) - 1]
        if isinstance(value, BaseException):
            raise value
        return value

    return predicate, calls


def test_wait_until_returns_the_first_truthy_value():
    predicate, calls = answers(0, "", None, "ready")
    assert polling.wait_until(predicate, timeout=5, interval=0.001) == "ready"
    assert len(calls) == 4


def test_wait_until_tries_once_more_after_the_deadline():
    # False before the deadline, true only on the try after it: met during the last sleep is not a failure
    predicate, calls = answers(False, True)
    assert polling.wait_until(predicate, timeout=0.01, interval=0.05) is True
    assert len(calls) == 2


def test_wait_until_tries_at_least_once_with_no_time_left():
    predicate, calls = answers("already")
    assert polling.wait_until(predicate, timeout=0) == "already"
    assert len(calls) == 1


def test_wait_until_fails_naming_what_it_waited_for():
    predicate, calls = answers(False)
    with pytest.raises(AssertionError, match=r"^every node in State not met within 0\.05 s$"):
        polling.wait_until(predicate, timeout=0.05, interval=0.01, what="every node in State")
    assert len(calls) >= 2


def test_wait_until_counts_a_tolerated_error_as_not_yet_and_raises_any_other():
    predicate, calls = answers(OSError("refused"), 7)
    assert polling.wait_until(predicate, timeout=5, interval=0.001, tolerate=(OSError,)) == 7
    assert len(calls) == 2
    predicate, calls = answers(OSError("refused"), 7)
    with pytest.raises(OSError, match="refused"):
        polling.wait_until(predicate, timeout=5, interval=0.001)
    assert len(calls) == 1


def test_the_old_names_are_the_one_helper():
    assert cluster.wait_until is polling.wait_until
    assert conftest_eventually is polling.eventually


def test_healing_wait_until_tolerates_a_node_between_leaders():
    # healing.py's wait_until: a failed request (an HTTP error or a refused connection) is "not yet"
    predicate, calls = answers(httpx.ConnectError("down"), ConnectionRefusedError(), {"leader": "n2"})
    assert healing.wait_until(predicate, timeout=5, interval=0.001) == {"leader": "n2"}
    assert len(calls) == 3
    predicate, calls = answers(ValueError("a bug"))
    with pytest.raises(ValueError, match="a bug"):
        healing.wait_until(predicate, timeout=5, interval=0.001)


async def test_eventually_returns_once_the_predicate_holds():
    predicate, calls = answers(False, False, True)
    await polling.eventually(predicate, timeout=5, interval=0.001)
    assert len(calls) == 3


async def test_eventually_fails_naming_what_it_waited_for():
    predicate, calls = answers(False)
    with pytest.raises(AssertionError, match=r"^the follower caught up not met within 0\.05 s$"):
        await polling.eventually(predicate, timeout=0.05, interval=0.01, what="the follower caught up")
    assert len(calls) >= 2
