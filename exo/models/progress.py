"""Download progress and retry timing: pure functions. Clocks come in as arguments."""

from __future__ import annotations

from dataclasses import dataclass

from exo.core.ids import ModelId, NodeId
from exo.core.types import DownloadProgress, DownloadStatus, FileProgress

SPEED_WINDOW_S = 5.0  # speed is measured over the last few seconds, so it follows changes


def speed(samples: list[tuple[float, int]], now: float, window: float = SPEED_WINDOW_S) -> float:
    """Bytes per second from (time, bytes done) samples, oldest first, over the last `window`."""
    recent = [s for s in samples if s[0] >= now - window] or samples[-1:]
    if len(recent) < 2:
        recent = samples[-2:]
    if len(recent) < 2 or recent[-1][0] <= recent[0][0]:
        return 0.0
    return max(0.0, (recent[-1][1] - recent[0][1]) / (recent[-1][0] - recent[0][0]))


def summarize(
    node_id: NodeId, model_id: ModelId, status: DownloadStatus, files: dict[str, tuple[int, int]],
    samples: list[tuple[float, int]], now: float, source: str = "", path: str = "",
) -> DownloadProgress:
    """One progress record from per-file (done, total) bytes and recent samples."""
    done = sum(d for d, _ in files.values())
    total = sum(t for _, t in files.values())
    rate = speed(samples, now) if status == "downloading" else 0.0
    eta = (total - done) / rate if rate > 0 else (0.0 if status == "completed" else None)
    return DownloadProgress(
        node_id=node_id, model_id=model_id, status=status, done_bytes=done, total_bytes=total,
        speed_bps=round(rate, 1), eta_s=None if eta is None else round(eta, 1),
        files=[FileProgress(path=p, done=d, total=t) for p, (d, t) in sorted(files.items())],
        source=source, path=path, updated_at=now,
    )


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries: `attempts` failures in a row without a byte of progress end it.
    Waits double from `base_delay_s` up to `max_delay_s`; a server's Retry-After wins but is
    capped at `max_retry_after_s` (a Hub asking for an hour is a failure to report, not wait)."""

    attempts: int = 5
    base_delay_s: float = 0.5
    max_delay_s: float = 30.0
    max_retry_after_s: float = 300.0


def next_delay(policy: RetryPolicy, failures: int, retry_after_s: float | None = None) -> float | None:
    """Seconds to wait before trying again after the `failures`-th failure in a row, or None
    to give up."""
    if failures >= policy.attempts:
        return None
    if retry_after_s is not None:
        return retry_after_s if retry_after_s <= policy.max_retry_after_s else None
    doubled: float = policy.base_delay_s * 2 ** (failures - 1)  # int ** int is typed Any (a negative power is a float)
    return min(policy.max_delay_s, doubled)
