"""How pytest-xdist shares the suite between its two workers: a file per worker at a time (module
fixtures start one exo per file), except the tests that form whole clusters and time their
recovery, which share one queue and so never run beside each other. Two of them side by side on
CI's two cores was the one way this suite failed in parallel (a soak recovery 16 s instead of
≤ 10 s, a three-server cluster not formed in 60 s); each still runs beside the lighter tests."""

from __future__ import annotations

from xdist.scheduler import LoadFileScheduling

ONE_AT_A_TIME = "the cluster tests, one after another"
CLUSTER_FILES = frozenset({
    "tests/test_soak.py", "tests/test_cluster_discovery.py", "tests/test_self_healing.py",
    "tests/test_compose_topology.py", "tests/test_cluster_netns.py", "tests/test_first_hour.py",
    "tests/test_cluster_migration.py", "tests/test_failover.py", "tests/test_partition.py", "tests/test_orphan_runners.py",
})


class ClusterTestsInOneQueue(LoadFileScheduling):
    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return ONE_AT_A_TIME if path in CLUSTER_FILES else super()._split_scope(nodeid)
