"""A local stand-in for the Hugging Face Hub on 127.0.0.1, for download tests without the internet.

It answers the routes huggingface_hub 2.4.0's ``snapshot_download`` / ``hf_hub_download`` /
``list_repo_files`` call (read from the installed library):

- ``GET /api/models/{repo}/revision/{rev}``: repo info with the commit ``sha``;
- ``GET /api/models/{repo}/tree/{rev}?recursive=True``: the file listing (one page, no ``Link``);
- ``HEAD|GET /{repo}/resolve/{rev}/{file}``: ``ETag``, ``X-Repo-Commit``, ``Content-Length``,
  ``Accept-Ranges`` and ``Range: bytes=N-`` (206) for resuming.

Errors carry the ``X-Error-Code`` header the client maps to its exceptions: an unknown repo is 404
``RepoNotFound``, an unknown revision 404 ``RevisionNotFound``, a missing file 404 ``EntryNotFound``,
and a gated repo's files answer 401 ``GatedRepo`` unless the request has ``Authorization: Bearer
<token>`` (its metadata is public, as on the real Hub). A file in ``drop_once`` breaks off halfway
the first time it is downloaded (the connection closes), so the client's resume can be seen.
Every request is logged in ``requests``.
"""
from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class FakeRepo:
    folder: Path
    commit: str = "a" * 40
    branches: tuple[str, ...] = ("main",)
    token: str | None = None  # set: the repo is gated and files need this bearer token
    drop_once: set[str] = field(default_factory=set)  # files whose first download breaks off halfway
    files: dict[str, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.files = {str(p.relative_to(self.folder)): p.read_bytes()
                      for p in sorted(self.folder.rglob("*")) if p.is_file()}

    def knows(self, rev: str) -> bool:
        return rev in self.branches or rev == self.commit


class FakeHub:
    def __init__(self, repos: dict[str, FakeRepo]) -> None:
        self.repos = repos
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                hub._handle(self, head=False)

            def do_HEAD(self) -> None:
                hub._handle(self, head=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FakeHub":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def file_requests(self, name: str) -> list[tuple[str, str, str | None]]:
        return [r for r in self.requests if "/resolve/" in r[1] and r[1].endswith("/" + name)]

    # ---- routing ------------------------------------------------------------------
    def _split_repo(self, rest: str) -> tuple[str | None, str]:
        for repo_id in self.repos:
            if rest == repo_id or rest.startswith(repo_id + "/"):
                return repo_id, rest[len(repo_id) + 1:]
        parts = rest.split("/", 2)
        return None, "/".join(parts[2:])

    def _handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        self.requests.append((h.command, path, h.headers.get("Range")))
        if path.startswith("/api/models/"):
            repo_id, rest = self._split_repo(path[len("/api/models/"):])
            if repo_id is None:
                return self._error(h, 404, "RepoNotFound", "Repository not found", head)
            repo = self.repos[repo_id]
            kind, _, rev = rest.partition("/")
            if kind not in ("revision", "tree"):
                return self._error(h, 404, None, "Not found", head)
            if not repo.knows(rev):
                return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
            if kind == "revision":
                body = {"id": repo_id, "sha": repo.commit, "private": False, "gated": "manual" if repo.token else False,
                        "siblings": [{"rfilename": f} for f in repo.files]}
            else:
                body = [{"type": "file", "path": f, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                        for f, data in repo.files.items()]
            return self._send(h, 200, json.dumps(body).encode(), {"Content-Type": "application/json"}, head)
        repo_id, rest = self._split_repo(path.lstrip("/"))
        if repo_id is None:
            return self._error(h, 404, "RepoNotFound", "Repository not found", head)
        repo = self.repos[repo_id]
        kind, _, rest = rest.partition("/")
        rev, _, filename = rest.partition("/")
        if kind != "resolve":
            return self._error(h, 404, None, "Not found", head)
        if not repo.knows(rev):
            return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
        if repo.token is not None and h.headers.get("Authorization") != f"Bearer {repo.token}":
            return self._error(h, 401, "GatedRepo", "Access to model is restricted. You must have access to it and "
                               "be authenticated to access it. Please log in.", head)
        if filename not in repo.files:
            return self._error(h, 404, "EntryNotFound", f"{filename} does not exist on {rev}", head)
        data = repo.files[filename]
        headers = {"ETag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Repo-Commit": repo.commit,
                   "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        status, body = 200, data
        rng = h.headers.get("Range")
        if rng and rng.startswith("bytes=") and not head:
            start_s, _, end_s = rng[len("bytes="):].partition("-")
            start, end = int(start_s), int(end_s) if end_s else len(data) - 1
            body = data[start:end + 1]
            status = 206
            headers["Content-Range"] = f"bytes {start}-{start + len(body) - 1}/{len(data)}"
        if filename in repo.drop_once and not head and status == 200:
            repo.drop_once.discard(filename)
            return self._break_off(h, headers, data)
        self._send(h, status, body, headers, head, length=len(body) if not head else len(data))

    def _break_off(self, h: BaseHTTPRequestHandler, headers: dict[str, str], data: bytes) -> None:
        """Announce the whole file, send half of it, close the connection."""
        import socket

        h.send_response(200)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data[:len(data) // 2])
        h.wfile.flush()
        h.close_connection = True
        h.connection.shutdown(socket.SHUT_RDWR)

    def _error(self, h: BaseHTTPRequestHandler, status: int, code: str | None, message: str, head: bool) -> None:
        headers = {"Content-Type": "application/json", "X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        self._send(h, status, json.dumps({"error": message}).encode(), headers, head)

    def _send(self, h: BaseHTTPRequestHandler, status: int, body: bytes, headers: dict[str, str], head: bool,
              length: int | None = None) -> None:
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body) if length is None else length))
        h.end_headers()
        if not head:
            h.wfile.write(body)
