"""A local stand-in for the Hugging Face Hub, good enough for `huggingface_hub` 2.x.

Point a process at it with `HF_ENDPOINT=<FakeHub.start()>` (set before huggingface_hub
is imported: its constants read the environment at import time) and
`snapshot_download` / `hf_hub_download` / `HfApi.model_info` / `list_repo_tree` work
against plain local directories.

What the client needs, and what this server therefore sends (see huggingface_hub's
`_snapshot_download.py`, `file_download.py`, `hf_api.py`, `utils/_http.py`):

* `GET /api/models/{repo}/revision/{rev}` (and `/api/models/{repo}`): JSON with `sha`
  (a 40-hex commit derived from the file contents) and `siblings`.
* `GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=...`: the file listing.
  Entries carry no `xetHash`, so the client never tries Xet.
* `HEAD|GET /{repo}/resolve/{rev}/{file}`: served directly (200, no CDN redirect)
  with `X-Repo-Commit` (mandatory, else FileMetadataError), a quoted `ETag`
  (git blob sha1, or sha256 for LFS-style files, which also get `X-Linked-Etag` /
  `X-Linked-Size` like the real Hub) and `Content-Length`. No `X-Xet-Hash` header,
  so again no Xet. `Range: bytes=N-` is honoured for resumed downloads.
* `GET /api/agent-harnesses`: an empty registry (huggingface_hub 2.4 fetches it to
  build its User-Agent unless HF_HUB_DISABLE_TELEMETRY=1).
* Errors carry `X-Error-Code` (`RepoNotFound`, `RevisionNotFound`, `EntryNotFound`,
  `GatedRepo`) and a JSON `{"error": ...}` body; `hf_raise_for_status` maps those headers to
  RepositoryNotFoundError / RevisionNotFoundError / RemoteEntryNotFoundError / GatedRepoError.

Failure knobs, for download tests (each applies to the next GET bodies of one file, keyed
"<repo_id>/<filename>" like `downloads`): `drop_after` sends part of the body and closes the
connection, `corrupt` sends the right length of wrong bytes, `rate_limit` answers 429 with
Retry-After. `gated` repos answer 403 GatedRepo on file downloads, as the Hub does before
their terms are accepted. `throttle_bps` slows every body down (progress tests). `ranges`
records the first byte of every body served.

Only model repos with ids of the form "namespace/name" are supported. Directory
contents are (re)hashed on demand, so editing a repo directory yields a new commit.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, BinaryIO
from urllib.parse import parse_qs, unquote, urlsplit

# Files the real Hub would store in LFS (by the default .gitattributes).
_LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".npz", ".pt", ".pth", ".h5", ".onnx", ".msgpack")
_DATE = "2024-01-01T00:00:00.000Z"
_FLIP = bytes(range(255, -1, -1))  # every byte inverted: same length, wrong content
# A failure knob queued for a file: ("drop", bytes sent first), ("corrupt",) or ("429", Retry-After seconds).
Fault = tuple[Any, ...]
Stamp = tuple[tuple[str, int, int], ...]  # (path, size, mtime) of every file of a repo directory


class _File:
    def __init__(self, rel: str, data: bytes):
        self.rel = rel
        self.size = len(data)
        self.sha256 = hashlib.sha256(data).hexdigest()
        self.git_oid = hashlib.sha1(b"blob %d\0" % self.size + data).hexdigest()
        self.lfs = rel.endswith(_LFS_SUFFIXES)
        if self.lfs:
            pointer = (
                f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {self.size}\n"
            ).encode()
            self.pointer_size = len(pointer)
            self.git_oid = hashlib.sha1(b"blob %d\0" % len(pointer) + pointer).hexdigest()
        # The Hub's ETag is the LFS sha256 for LFS files and the git blob id otherwise;
        # the client names cached blobs after it.
        self.etag = self.sha256 if self.lfs else self.git_oid

    def tree_entry(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"type": "file", "oid": self.git_oid, "size": self.size, "path": self.rel}
        if self.lfs:
            entry["lfs"] = {"oid": self.sha256, "size": self.size, "pointerSize": self.pointer_size}
        return entry

    def sibling(self, blobs: bool) -> dict[str, Any]:
        entry: dict[str, Any] = {"rfilename": self.rel}
        if blobs:
            entry |= {"size": self.size, "blobId": self.git_oid}
            if self.lfs:
                entry["lfs"] = {"size": self.size, "sha256": self.sha256, "pointerSize": self.pointer_size}
        return entry


class _Snapshot:
    """Files of one repo directory at one moment, plus a content-derived commit id."""

    def __init__(self, root: pathlib.Path):
        self.root = root
        self.files: dict[str, _File] = {}
        for p in sorted(root.rglob("*")):
            rel = p.relative_to(root).as_posix()
            if p.is_file() and ".git" not in rel.split("/"):
                self.files[rel] = _File(rel, p.read_bytes())
        digest = hashlib.sha1()
        for rel, f in self.files.items():
            digest.update(f"{rel}\0{f.sha256}\n".encode())
        self.commit = digest.hexdigest()

    def folders(self) -> list[str]:
        out: set[str] = set()
        for rel in self.files:
            parts = rel.split("/")[:-1]
            out.update("/".join(parts[: i + 1]) for i in range(len(parts)))
        return sorted(out)


class FakeHub:
    """Serve `repos` (repo id -> local directory) on 127.0.0.1 like the HF Hub does.

    `downloads["<repo_id>/<filename>"]` counts file bodies served (GET on /resolve),
    so tests can tell a real download from a cache hit. `requests` logs
    "METHOD /path" for every request, for debugging.
    """

    def __init__(self, repos: dict[str, pathlib.Path]):
        self.repos = {repo_id: pathlib.Path(path) for repo_id, path in repos.items()}
        self.downloads: dict[str, int] = {}
        self.requests: list[str] = []
        self.ranges: list[tuple[str, int]] = []  # (repo_id/filename, first byte) per body served
        self.gated: set[str] = set()
        # "<repo_id>/<filename>" -> the size the file listing shows (a huge model without its bytes)
        self.listed_sizes: dict[str, int] = {}
        self.throttle_bps: int | None = None
        self._faults: dict[str, list[Fault]] = {}
        self._connections: set[socket.socket] = set()  # open keep-alive connections, closed by stop()
        self._lock = threading.Lock()
        self._snapshots: dict[pathlib.Path, tuple[Stamp, _Snapshot]] = {}
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.endpoint: str | None = None

    def start(self) -> str:
        """Bind a free port, serve in a daemon thread, return the endpoint URL."""
        hub = self

        class Handler(_Handler):
            fake_hub = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._server.block_on_close = False
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-hub", daemon=True)
        self._thread.start()
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        return self.endpoint

    def stop(self) -> None:
        """Stop listening and close every open connection: a client's keep-alive connection
        must not outlive the Hub (a real Hub that goes away takes them with it)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self._lock:
            connections, self._connections = list(self._connections), set()
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> FakeHub:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def drop_after(self, key: str, nbytes: int, times: int = 1) -> None:
        """The next `times` bodies of `key` stop after `nbytes` bytes: the connection closes."""
        self._add_fault(key, ("drop", nbytes), times)

    def corrupt(self, key: str, times: int = 1) -> None:
        """The next `times` bodies of `key` have the right length and the wrong bytes."""
        self._add_fault(key, ("corrupt",), times)

    def rate_limit(self, key: str, retry_after: int = 1, times: int = 1) -> None:
        """The next `times` GETs of `key` answer 429 with `Retry-After: retry_after`."""
        self._add_fault(key, ("429", retry_after), times)

    def _add_fault(self, key: str, fault: Fault, times: int) -> None:
        with self._lock:
            self._faults.setdefault(key, []).extend([fault] * times)

    def _next_fault(self, key: str) -> Fault | None:
        with self._lock:
            queue = self._faults.get(key)
            return queue.pop(0) if queue else None

    def _log(self, line: str) -> None:
        with self._lock:
            self.requests.append(line)

    def _count_download(self, key: str) -> None:
        with self._lock:
            self.downloads[key] = self.downloads.get(key, 0) + 1

    def _snapshot(self, root: pathlib.Path) -> _Snapshot:
        # Rehash only when a file's (path, size, mtime) changed, so big repos stay cheap.
        stats = ((p, p.stat()) for p in root.rglob("*") if p.is_file())
        stamp = tuple(sorted((str(p), st.st_size, st.st_mtime_ns) for p, st in stats))
        with self._lock:
            cached = self._snapshots.get(root)
        if cached is None or cached[0] != stamp:
            cached = (stamp, _Snapshot(root))
            with self._lock:
                self._snapshots[root] = cached
        return cached[1]


class _Handler(BaseHTTPRequestHandler):
    fake_hub: FakeHub
    protocol_version = "HTTP/1.1"  # keep-alive, like the client's connection pool expects

    def log_message(self, format: str, *args: object) -> None:  # silence stderr access log
        pass

    def setup(self) -> None:
        super().setup()
        with self.fake_hub._lock:
            self.fake_hub._connections.add(self.connection)

    def finish(self) -> None:
        with self.fake_hub._lock:
            self.fake_hub._connections.discard(self.connection)
        try:
            super().finish()
        except OSError:  # the connection was shut down by stop()
            pass

    # -- plumbing -----------------------------------------------------------------

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
              content_type: str = "application/json; charset=utf-8", length: int | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    def _json(self, obj: object, status: int = 200, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), headers)

    def _error(self, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
        headers = {"X-Error-Code": code, "X-Error-Message": message, **(headers or {})}
        self._json({"error": message}, status, headers)

    def _snapshot(self, repo_id: str, revision: str) -> _Snapshot | None:
        """Resolve repo+revision or send the Hub's error response and return None."""
        root = self.fake_hub.repos.get(repo_id)
        if root is None or not root.is_dir():
            self._error(404, "RepoNotFound", "Repository not found")
            return None
        snap = self.fake_hub._snapshot(root)
        if revision not in ("main", snap.commit):
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return None
        return snap

    # -- routes -------------------------------------------------------------------

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        self.fake_hub._log(f"{self.command} {url.path}")
        if parts == ["api", "agent-harnesses"]:
            # Fetched once by huggingface_hub's user-agent builder (unless telemetry is off).
            self._json({"standardEnvVars": [], "harnesses": {}})
        elif len(parts) >= 3 and parts[:2] == ["api", "models"]:
            self._api(f"{parts[2]}/{parts[3]}" if len(parts) > 3 else parts[2], parts[4:], query)
        elif len(parts) >= 5 and parts[2] == "resolve":
            self._resolve(f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]))
        else:
            self._json({"error": "Not found"}, 404)

    def _listed(self, repo_id: str, entry: dict[str, Any]) -> dict[str, Any]:
        size = self.fake_hub.listed_sizes.get(f"{repo_id}/{entry['path']}")
        if size is None:
            return entry
        return entry | {"size": size} | ({"lfs": entry["lfs"] | {"size": size}} if "lfs" in entry else {})

    def _api(self, repo_id: str, rest: list[str], query: dict[str, list[str]]) -> None:
        flag = lambda name: query.get(name, ["false"])[0].lower() in ("1", "true")  # noqa: E731
        if not rest:
            rest = ["revision", "main"]
        if rest[0] == "revision" and len(rest) == 2:
            snap = self._snapshot(repo_id, rest[1])
            if snap is None:
                return
            self._json({
                "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24],
                "id": repo_id,
                "modelId": repo_id,
                "author": repo_id.split("/")[0],
                "sha": snap.commit,
                "lastModified": _DATE,
                "createdAt": _DATE,
                "private": False,
                "gated": "manual" if repo_id in self.fake_hub.gated else False,
                "disabled": False,
                "downloads": 0,
                "likes": 0,
                "library_name": "mlx",
                "tags": ["mlx", "safetensors"],
                "siblings": [f.sibling(flag("blobs")) for f in snap.files.values()],
                "usedStorage": sum(f.size for f in snap.files.values()),
            })
        elif rest[0] == "tree" and len(rest) >= 2:
            snap = self._snapshot(repo_id, rest[1])
            if snap is None:
                return
            base = "/".join(rest[2:]).strip("/")
            prefix = f"{base}/" if base else ""
            if base and base not in snap.folders():
                self._error(404, "EntryNotFound", f"{base} does not exist on \"{rest[1]}\"")
                return
            entries = [
                {"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0, "path": d}
                for d in snap.folders()
            ] + [self._listed(repo_id, f.tree_entry()) for f in snap.files.values()]
            recursive = flag("recursive")
            self._json([
                e for e in entries
                if e["path"].startswith(prefix) and (recursive or "/" not in e["path"][len(prefix):])
            ])
        else:
            self._json({"error": "Not found"}, 404)

    def _resolve(self, repo_id: str, revision: str, filename: str) -> None:
        snap = self._snapshot(repo_id, revision)
        if snap is None:
            return
        f = snap.files.get(filename)
        commit = {"X-Repo-Commit": snap.commit}
        if f is None:
            self._error(404, "EntryNotFound", "Entry not found", commit)
            return
        if repo_id in self.fake_hub.gated:
            self._error(403, "GatedRepo", "Access to this model is restricted: accept its terms first", commit)
            return
        headers = {**commit, "ETag": f'"{f.etag}"', "Accept-Ranges": "bytes"}
        if f.lfs:
            headers |= {"X-Linked-Etag": f'"{f.etag}"', "X-Linked-Size": str(f.size)}
        if self.command == "HEAD":
            self._send(200, headers=headers, content_type="application/octet-stream", length=f.size)
            return
        status, start = 200, 0
        range_header = self.headers.get("Range", "")
        if range_header.startswith("bytes=") and range_header[6:].split("-")[0].isdigit():
            start = min(int(range_header[6:].split("-")[0]), f.size)  # only "bytes=N-", as the client sends
            status = 206
            headers["Content-Range"] = f"bytes {start}-{f.size - 1}/{f.size}"
        key = f"{repo_id}/{filename}"
        fault = self.fake_hub._next_fault(key)
        if fault is not None and fault[0] == "429":
            self._error(429, "RateLimited", "Too many requests", {"Retry-After": str(fault[1])})
            return
        self.fake_hub._count_download(key)
        with self.fake_hub._lock:
            self.fake_hub.ranges.append((key, start))
        self._send(status, headers=headers, content_type="application/octet-stream", length=f.size - start)
        with open(snap.root / filename, "rb") as fh:
            fh.seek(start)
            self._write_body(fh, f.size - start, fault)

    def _write_body(self, fh: BinaryIO, length: int, fault: Fault | None) -> None:
        limit = fault[1] if fault is not None and fault[0] == "drop" else length
        throttle = self.fake_hub.throttle_bps
        sent = 0
        while sent < min(limit, length):
            block = fh.read(min(64 << 10, limit - sent))
            if not block:
                break
            if fault is not None and fault[0] == "corrupt":
                block = block.translate(_FLIP)
            self.wfile.write(block)
            sent += len(block)
            if throttle:
                time.sleep(len(block) / throttle)
        if sent < length:  # a dropped connection: the client sees a short body
            self.wfile.flush()
            self.close_connection = True
