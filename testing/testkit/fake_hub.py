"""A Hugging Face Hub stand-in on loopback, for `HF_ENDPOINT`: the endpoints
`huggingface_hub` calls to resolve a revision and download files, answered as the Hub
answers them, with switches to make it fail the ways the Hub and the network do.

- `GET /api/models/{org}/{name}[/revision/{rev}][?blobs=true]`: the model's info, `sha`
  (the commit), `gated`, and `siblings` (with `?blobs=true`: `size`, `blobId` (git's blob
  SHA-1) and, for LFS files, `lfs: {sha256, size, pointerSize}`).
- `HEAD|GET /{org}/{name}/resolve/{rev}/{path}`: the file, with `X-Repo-Commit`, `ETag`
  (the sha256 for LFS files, the blob SHA-1 otherwise), `X-Linked-Etag`/`X-Linked-Size`
  for LFS files, `Accept-Ranges` and `Range` (206 with `Content-Range`).
- `GET /api/agent-harnesses`: an empty list (huggingface_hub asks for it once a day, without
  a token, to name the coding agent in its user agent).
- Errors as the Hub sends them (`X-Error-Code`): RepoNotFound (401 without a token, 404
  with one), RevisionNotFound (404), GatedRepo (401 without a token, 403 with one that
  has not accepted the license), EntryNotFound (404), "Invalid credentials" (401).

Switches: `cdn_host` (say "localhost" when the Hub is at 127.0.0.1) answers an LFS file's
`/resolve` with a 302 to `/cdn-lfs/...` on that host, with the file's metadata on the
redirect, as the Hub sends LFS files to its CDN (huggingface_hub then downloads from there
without the token); `gated`/`private` and the accepted `tokens` per repository; `corrupt[path] = n`
serves the next n GETs of a file with one byte changed (-1: always); `cut[path] = n` cuts
the connection halfway through the next n GETs of a file; `hold[path]` (an Event) keeps a
GET of the file waiting after its first half until the event is set. Every request is recorded
(`requests`), with the bytes each body carried (`bytes_served(path)`).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf", ".model")


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


@dataclass
class FakeRepo:
    """A model repository: commits (commit -> {path: bytes}) and refs (branch or tag ->
    commit). `lfs` decides which files the Hub stores with LFS."""

    repo: str
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    gated: bool = False
    private: bool = False
    tokens: set[str] = field(default_factory=set)  # tokens that may read a gated or private repo

    def add_commit(self, files: dict[str, bytes], ref: str = "main") -> str:
        h = hashlib.sha1(usedforsecurity=False)
        h.update(str(len(self.commits)).encode())
        for path in sorted(files):
            h.update(path.encode() + b"\0" + hashlib.sha256(files[path]).digest())
        commit = h.hexdigest()
        self.commits[commit] = dict(files)
        self.refs[ref] = commit
        return commit

    @staticmethod
    def is_lfs(path: str, data: bytes) -> bool:
        return path.endswith(LFS_SUFFIXES) or len(data) > 10 * 1024 * 1024

    def resolve(self, revision: str) -> str | None:
        if revision in self.commits:
            return revision
        return self.refs.get(revision)


@dataclass
class Request:
    method: str
    path: str  # the repository file's path for /resolve, else the URL path
    revision: str | None
    range: str | None
    token: str | None
    status: int
    body_bytes: int


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.corrupt: dict[str, int] = {}
        self.cut: dict[str, int] = {}
        self.hold: dict[str, threading.Event] = {}
        self.cdn_host: str | None = None
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    # -- the repositories -------------------------------------------------------------

    def add_repo(self, repo: str, files: dict[str, bytes], **kwargs: Any) -> FakeRepo:
        r = FakeRepo(repo, **kwargs)
        r.add_commit(files)
        self.repos[repo] = r
        return r

    def add_folder(self, repo: str, folder: Path, **kwargs: Any) -> FakeRepo:
        files = {p.relative_to(folder).as_posix(): p.read_bytes()
                 for p in sorted(folder.rglob("*")) if p.is_file() and not p.name.startswith(".")}  # fmt: skip
        return self.add_repo(repo, files, **kwargs)

    # -- what it served ---------------------------------------------------------------

    def file_requests(self, path: str | None = None, method: str | None = None) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if r.revision is not None and (path is None or r.path == path)
                    and (method is None or r.method == method)]  # fmt: skip

    def bytes_served(self, path: str | None = None) -> int:
        return sum(r.body_bytes for r in self.file_requests(path, "GET"))

    # -- the server -------------------------------------------------------------------

    def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_HEAD(self) -> None:  # noqa: N802
                hub._handle(self, head=True)

            def do_GET(self) -> None:  # noqa: N802
                hub._handle(self, head=False)

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="fake-hub", daemon=True).start()
        return self.url

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        assert isinstance(host, str)
        return f"http://{host}:{port}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeHub:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- answers ----------------------------------------------------------------------

    def _handle(self, h: BaseHTTPRequestHandler, *, head: bool) -> None:
        url = urlsplit(h.path)
        auth = h.headers.get("Authorization", "")
        token = auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else None
        parts = url.path.split("/")
        # Recorded as it arrives (a held transfer is visible); status and bytes as they go.
        record = Request(h.command, url.path, None, h.headers.get("Range"), token, 0, 0)
        with self._lock:
            self.requests.append(record)
        if url.path == "/api/agent-harnesses":
            self._json(h, record, {"standardEnvVars": [], "harnesses": {}})
        elif len(parts) >= 5 and parts[1:3] == ["api", "models"]:
            self._model_info(h, record, parts[3:], parse_qs(url.query), token)
        elif len(parts) >= 6 and parts[3] == "resolve":
            self._resolve(h, record, parts, token, head)
        elif len(parts) >= 6 and parts[1] == "cdn-lfs":
            self._cdn(h, record, parts, head)
        else:
            self._error(h, record, 404, None, "not found")

    def _access(self, h: BaseHTTPRequestHandler, record: Request, repo_id: str,
                token: str | None, *, files: bool) -> FakeRepo | None:  # fmt: skip
        repo = self.repos.get(repo_id)
        if token is not None and token.startswith("bad"):
            self._error(h, record, 401, None, "Invalid credentials in Authorization header")
            return None
        if repo is None or (repo.private and token not in repo.tokens):
            self._error(h, record, 404 if token else 401, "RepoNotFound", "Repository not found")
            return None
        if files and repo.gated and token not in repo.tokens:
            self._error(
                h, record, 403 if token else 401, "GatedRepo", "Access to this model is restricted"
            )
            return None
        return repo

    def _at_revision(self, h: BaseHTTPRequestHandler, record: Request, repo_id: str,
                     revision: str, token: str | None, *,
                     files: bool) -> tuple[FakeRepo, str] | None:  # fmt: skip
        """The repository and the commit `revision` names, or None with the Hub's error sent."""
        repo = self._access(h, record, repo_id, token, files=files)
        if repo is None:
            return None
        commit = repo.resolve(revision)
        if commit is None:
            self._error(h, record, 404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return None
        return repo, commit

    def _model_info(self, h: BaseHTTPRequestHandler, record: Request, rest: list[str],
                    query: dict[str, list[str]], token: str | None) -> None:  # fmt: skip
        repo_id = "/".join(rest[:2])
        revision = unquote(rest[3]) if len(rest) >= 4 and rest[2] == "revision" else "main"
        found = self._at_revision(h, record, repo_id, revision, token, files=False)
        if found is None:
            return
        repo, commit = found
        blobs = query.get("blobs", ["false"])[0].lower() == "true"
        siblings = []
        for path, data in sorted(repo.commits[commit].items()):
            s: dict[str, Any] = {"rfilename": path}
            if blobs:
                s["size"] = len(data)
                s["blobId"] = git_blob_sha1(data)
                if repo.is_lfs(path, data):
                    s["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
                                "pointerSize": 134}  # fmt: skip
            siblings.append(s)
        doc = {"_id": commit[:24], "id": repo_id, "modelId": repo_id, "sha": commit,
               "private": repo.private, "gated": "manual" if repo.gated else False,
               "disabled": False, "tags": [], "siblings": siblings}  # fmt: skip
        self._json(h, record, doc)

    def _json(self, h: BaseHTTPRequestHandler, record: Request, doc: dict[str, Any]) -> None:
        body = json.dumps(doc).encode()
        record.status = 200
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _resolve(self, h: BaseHTTPRequestHandler, record: Request, parts: list[str],
                 token: str | None, head: bool) -> None:  # fmt: skip
        repo_id = "/".join(parts[1:3])
        revision = unquote(parts[4])
        path = unquote("/".join(parts[5:]))
        record.path, record.revision = path, revision
        found = self._at_revision(h, record, repo_id, revision, token, files=True)
        if found is None:
            return
        repo, commit = found
        data = repo.commits[commit].get(path)
        if data is None:
            self._error(h, record, 404, "EntryNotFound", f"{path} does not exist", commit)
            return
        lfs = repo.is_lfs(path, data)
        etag = hashlib.sha256(data).hexdigest() if lfs else git_blob_sha1(data)
        if lfs and self.cdn_host is not None:
            # As the Hub does for LFS files: a redirect to another host (a signed CDN URL),
            # the file's metadata on the redirect itself.
            port = urlsplit(self.url).port
            location = f"http://{self.cdn_host}:{port}/cdn-lfs/{repo_id}/{commit}/{quote(path)}"
            record.status = 302
            h.send_response(302)
            h.send_header("Location", location)
            h.send_header("ETag", f'"{etag}"')
            h.send_header("X-Repo-Commit", commit)
            h.send_header("X-Linked-Etag", f'"{etag}"')
            h.send_header("X-Linked-Size", str(len(data)))
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        self._send_file(h, record, path, data, commit, etag, lfs, head)

    def _cdn(
        self, h: BaseHTTPRequestHandler, record: Request, parts: list[str], head: bool
    ) -> None:
        """`/cdn-lfs/{org}/{name}/{commit}/{path}`: an LFS file's bytes, no token needed (the
        Hub's CDN URLs are signed)."""
        repo = self.repos.get("/".join(parts[2:4]))
        commit = parts[4]
        path = unquote("/".join(parts[5:]))
        record.path, record.revision = path, commit
        data = repo.commits.get(commit, {}).get(path) if repo is not None else None
        if data is None:
            self._error(h, record, 404, None, "no such object")
            return
        etag = hashlib.sha256(data).hexdigest()
        self._send_file(h, record, path, data, commit, etag, True, head)

    def _send_file(self, h: BaseHTTPRequestHandler, record: Request, path: str, data: bytes,
                   commit: str, etag: str, lfs: bool, head: bool) -> None:  # fmt: skip
        start, end = 0, len(data) - 1
        status = 200
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", record.range or "")
        if m and not head:
            start = int(m.group(1))
            end = int(m.group(2)) if m.group(2) else len(data) - 1
            status = 206
        body = data[start : end + 1]
        cut = False
        if not head:
            with self._lock:
                if self.corrupt.get(path, 0) != 0:
                    self.corrupt[path] -= 1
                    body = bytes([body[0] ^ 0xFF]) + body[1:] if body else body
                if self.cut.get(path, 0) > 0 and len(body) > 1:
                    self.cut[path] -= 1
                    cut = True
        h.send_response(status)
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(len(body)))
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("ETag", f'"{etag}"')
        h.send_header("X-Repo-Commit", commit)
        if lfs:
            h.send_header("X-Linked-Etag", f'"{etag}"')
            h.send_header("X-Linked-Size", str(len(data)))
        if status == 206:
            h.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        h.end_headers()
        record.status = status
        if head:
            return
        sent = body[: len(body) // 2] if cut else body
        held = self.hold.get(path)
        if held is not None:
            h.wfile.write(sent[: len(sent) // 2])
            h.wfile.flush()
            held.wait(timeout=60)
            h.wfile.write(sent[len(sent) // 2 :])
        else:
            h.wfile.write(sent)
        h.wfile.flush()
        record.body_bytes = len(sent)
        if cut:
            h.close_connection = True
            h.connection.shutdown(2)

    def _error(self, h: BaseHTTPRequestHandler, record: Request, status: int, code: str | None,
               message: str, commit: str | None = None) -> None:  # fmt: skip
        body = json.dumps({"error": message}).encode()
        record.status = status
        h.send_response(status)
        if code:
            h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        if commit:
            h.send_header("X-Repo-Commit", commit)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(body)
