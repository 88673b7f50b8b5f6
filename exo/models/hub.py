"""The Hugging Face Hub as a source, through huggingface-hub (so HF_ENDPOINT, HF_TOKEN, proxies
and HF_HUB_OFFLINE apply). Blocking: callers run these in threads.

The listing comes from `HfApi` (sizes, LFS sha256, git blob ids, at one commit); file bodies
are streamed with huggingface-hub's own HTTP session so we can resume with Range, hash as bytes
arrive, and retry on our terms: bounded, with backoff, honouring a 429's Retry-After.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from exo.core.types import DownloadErrorCode
from exo.models.files import FileMeta, Manifest
from exo.models.progress import RetryPolicy, next_delay
from exo.models.transfer import Corrupt, DownloadCancelled, DownloadError, PartialFile

if TYPE_CHECKING:
    import httpx2

# huggingface-hub (and httpx2 under it) is imported where a download or a listing needs it, not
# when a node starts: it was a third of every exo process's start-up CPU, and most never touch the Hub.

log = logging.getLogger(__name__)

T = TypeVar("T")

_CORRUPT_REFETCHES = 2  # a file that fails verification is fetched again this many times


@dataclass
class _Retry(Exception):
    """A failure worth trying again (network, 5xx, 429)."""

    code: DownloadErrorCode
    reason: str
    retry_after: float | None = None


def set_offline() -> None:
    """`exo --offline`: huggingface-hub itself refuses to touch the network from now on (its
    constants module alone is cheap to import: the package loads the rest on first use)."""
    from huggingface_hub import constants

    constants.HF_HUB_OFFLINE = True


def classify(error: BaseException, what: str) -> DownloadError | _Retry:
    """What a Hub failure means for a download of `what` (a repository or a file)."""
    if isinstance(error, (DownloadError, _Retry)):
        return error
    import httpx2
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    if isinstance(error, OfflineModeIsEnabled):
        return DownloadError("offline", f"offline mode: cannot fetch {what} from the Hub")
    # Repository-wide refusals name the repository, whichever of its files met them first.
    if isinstance(error, GatedRepoError):  # before RepositoryNotFoundError: it is a subclass
        repo = error.repo_id or what
        return DownloadError("gated", f"{repo} is gated: accept its terms on the Hub and set HF_TOKEN")
    if isinstance(error, RepositoryNotFoundError):
        repo = error.repo_id or what
        return DownloadError("not_found", f"repository not found on the Hub: {repo} (a private one needs HF_TOKEN)")
    if isinstance(error, RevisionNotFoundError):
        return DownloadError("not_found", f"revision not found on the Hub: {what}")
    if isinstance(error, RemoteEntryNotFoundError):
        return DownloadError("not_found", f"file not found on the Hub: {what}")
    if isinstance(error, HfHubHTTPError) and error.response is not None:
        return _classify_status(error.response, what)
    if isinstance(error, httpx2.TransportError):
        return _Retry("network", f"network failure fetching {what}: {type(error).__name__}: {error}")
    return DownloadError("unknown", f"cannot fetch {what}: {type(error).__name__}: {error}")


def _classify_status(response: httpx2.Response, what: str) -> DownloadError | _Retry:
    status = response.status_code
    if status in (401, 403):
        return DownloadError("unauthorized", f"the Hub refused {what} (HTTP {status}): check HF_TOKEN")
    if status == 404:  # no X-Error-Code (a proxy, an old mirror): still the Hub's own "no such thing"
        return DownloadError("not_found", f"the Hub has no {what} (HTTP 404)")
    if status == 429:
        after = response.headers.get("Retry-After", "").strip()
        wait = float(after) if after.replace(".", "", 1).isdigit() else None
        return _Retry("rate_limited", f"the Hub is rate limiting {what} (HTTP 429)", wait)
    if status == 408 or status >= 500:
        return _Retry("network", f"the Hub failed on {what} (HTTP {status})")
    return DownloadError("unknown", f"the Hub answered HTTP {status} for {what}")


def with_retries(action: Callable[[], T], what: str, policy: RetryPolicy, cancelled: threading.Event,
                 progressed: Callable[[], bool] = lambda: False) -> T:
    """Run `action` until it succeeds, a failure is final, or `policy` gives up. A failure after
    some progress (`progressed()` true) starts the count again."""
    failures = 0
    while True:
        if cancelled.is_set():
            raise DownloadCancelled(what)
        try:
            return action()
        except (DownloadCancelled, Corrupt):
            raise
        except Exception as error:  # noqa: BLE001 - classify decides what is final
            outcome = classify(error, what)
            if isinstance(outcome, DownloadError):
                raise outcome from None
            failures = 1 if progressed() else failures + 1
            delay = next_delay(policy, failures, outcome.retry_after)
            if delay is None:
                raise DownloadError(outcome.code, f"{outcome.reason}; gave up after {failures} attempts") from None
            log.warning("%s; retrying in %.1f s (attempt %d of %d)",
                        outcome.reason, delay, failures + 1, policy.attempts)
            if cancelled.wait(delay):
                raise DownloadCancelled(what) from None


def hub_manifest(repo_id: str, revision: str, endpoint: str | None, policy: RetryPolicy,
                 cancelled: threading.Event) -> Manifest:
    """Every file of the repository at the commit `revision` points to now."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    api = HfApi(endpoint=endpoint)

    def listing() -> Manifest:
        commit = api.model_info(repo_id, revision=revision).sha or revision
        files = {
            e.path: FileMeta(size=e.size, sha256=e.lfs.sha256 if e.lfs else "", git_oid=e.blob_id)
            for e in api.list_repo_tree(repo_id, revision=commit, recursive=True) if isinstance(e, RepoFile)
        }
        return Manifest(repo_id=repo_id, revision=revision, commit=commit, files=files)

    return with_retries(listing, f"{repo_id}@{revision}", policy, cancelled)


def fetch_from_hub(manifest: Manifest, partial: PartialFile, endpoint: str | None, policy: RetryPolicy,
                   cancelled: threading.Event) -> FileMeta:
    """Download one file of `manifest` into `partial` (opened), resuming, verifying, retrying."""
    from huggingface_hub import hf_hub_url

    url = hf_hub_url(manifest.repo_id, partial.path, revision=manifest.commit or manifest.revision, endpoint=endpoint)
    what = f"{manifest.repo_id}/{partial.path}"
    for attempt in range(_CORRUPT_REFETCHES + 1):
        with_retries(lambda: _get_into(url, partial, cancelled), what, policy, cancelled, _grew(partial))
        try:
            return partial.finish()
        except Corrupt as corrupt:
            log.warning("%s failed verification (%s); fetching it again", what, corrupt)
            partial.open()
            if attempt == _CORRUPT_REFETCHES:
                raise DownloadError("corrupt", f"{corrupt} (fetched {attempt + 1} times)") from None
    raise AssertionError("unreachable")


def _grew(partial: PartialFile) -> Callable[[], bool]:
    """Whether `partial` grew since the last call: a failure after progress starts the count again."""
    last = [partial.size]

    def check() -> bool:
        grew, last[0] = partial.size > last[0], partial.size
        return grew

    return check


def _get_into(url: str, partial: PartialFile, cancelled: threading.Event) -> None:
    import httpx2
    from huggingface_hub import constants
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    start = partial.size
    if start == partial.meta.size:
        return  # all there already: only verification is left
    headers = build_hf_headers()
    if start:
        headers["Range"] = f"bytes={start}-"
    timeout = httpx2.Timeout(connect=10.0, read=max(constants.HF_HUB_DOWNLOAD_TIMEOUT, 30), write=30.0, pool=30.0)
    with get_session().stream("GET", url, headers=headers, timeout=timeout) as response:
        if response.status_code >= 400:
            response.read()
            hf_raise_for_status(response)
        if start and response.status_code != 206:
            partial.reset()  # the server ignored the range: take the whole file again
        for data in response.iter_bytes():  # as it arrives: a chunk size would hold bytes back from a dropped body
            if cancelled.is_set():
                raise DownloadCancelled(partial.path)
            partial.write(data)
