"""A tiny in-memory Hugging Face Hub on 127.0.0.1, for offline tests of uploads and `from_pretrained` downloads.

It speaks only the endpoints huggingface_hub 2.4 calls for `create_repo`, `create_branch`, `create_commit` /
`upload_folder` (preupload, commit), `validate-yaml`, `repo_info`, Space variables, tree listings and file
downloads (`/{repo}/resolve/{rev}/{path}`). Every file is answered as a "regular" (base64-in-the-commit) upload, so
no LFS or Xet storage is ever negotiated. Anything else gets a 404 and is recorded in `unhandled`, so a test can see
what a new huggingface_hub started to call.

Point a client at it with `HF_ENDPOINT=hub.url` (read at import time: set it for a subprocess, or patch
`huggingface_hub.constants.ENDPOINT` in-process).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}
API = re.compile(
    r"^/api/(models|datasets|spaces)/([^/]+/[^/]+)(?:/(preupload|commit|revision|branch|tree|variables)(?:/([^/]+))?(?:/(.*))?)?$"
)
RESOLVE = re.compile(r"^/(?:(datasets|spaces)/)?([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


@dataclass
class Repo:
    repo_type: str
    repo_id: str
    private: bool
    sdk: str | None = None
    branches: dict[str, str] = field(default_factory=dict)  # branch -> commit sha
    snapshots: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit sha -> {path: content}
    commits: list[dict] = field(default_factory=list)  # {"sha", "branch", "summary", "paths"}
    variables: dict[str, str] = field(default_factory=dict)

    def commit(self, branch: str, files: dict[str, bytes], summary: str) -> str:
        parent = self.branches.get(branch, "")
        digest = hashlib.sha1(parent.encode() + summary.encode() + str(len(self.commits)).encode())
        for path in sorted(files):
            digest.update(path.encode() + hashlib.sha1(files[path]).digest())
        sha = digest.hexdigest()
        self.snapshots[sha], self.branches[branch] = files, sha
        self.commits.append({"sha": sha, "branch": branch, "summary": summary, "paths": sorted(files)})
        return sha

    def resolve(self, revision: str) -> str | None:
        """Commit sha of a branch name or a (full) commit sha."""
        return self.branches.get(revision) or (revision if revision in self.snapshots else None)

    def files(self, revision: str = "main") -> dict[str, bytes]:
        return self.snapshots[self.resolve(revision)]


def _now() -> str:
    return datetime.now(timezone.utc).strftime(
        "%Y-%m-%dT%H:%M:%S.%fZ"
    )  # the Hub's format, as huggingface_hub parses it


class FakeHub:
    """`with FakeHub() as hub:` serves on `hub.url`; `hub.repos[(repo_type, repo_id)]` holds what arrived."""

    def __init__(self):
        self.repos: dict[tuple[str, str], Repo] = {}
        self.create_payloads: list[dict] = []  # bodies of POST /api/repos/create, as received
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Authorization header) of each request
        self.unhandled: list[str] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeHub:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def repo(self, repo_id: str, repo_type: str = "model") -> Repo:
        return self.repos[(repo_type, repo_id)]


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the real Hub; every answer carries a Content-Length

        def log_message(self, *args):  # quiet
            pass

        # -- plumbing
        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False):
            self.send_response(status)
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _json(self, status: int, obj, error_code: str | None = None):
            headers = {"Content-Type": "application/json"}
            if error_code:
                headers.update({"X-Error-Code": error_code, "X-Error-Message": str(obj.get("error", ""))})
            self._send(status, json.dumps(obj).encode(), headers)

        def _not_found(self, error_code: str, message: str, head: bool = False):
            self._send(
                404,
                json.dumps({"error": message}).encode(),
                {"X-Error-Code": error_code, "X-Error-Message": message, "Content-Type": "application/json"},
                head,
            )

        def _repo(self, repo_type: str, repo_id: str) -> Repo | None:
            repo = hub.repos.get((repo_type, repo_id))
            if repo is not None and repo.private and not self.headers.get("Authorization"):
                return None  # the real Hub hides private repos from anonymous callers
            return repo

        def _route(self, method: str):
            path = urlsplit(self.path).path  # matched raw, then unquoted: a revision may hold a quoted "/"
            hub.requests.append((method, path, self.headers.get("Authorization")))
            if path == "/api/agent-harnesses":  # huggingface_hub's best-effort telemetry registry: "none here"
                return self._not_found("EntryNotFound", "no registry", head=method == "HEAD")
            with hub.lock:
                if method == "POST" and path == "/api/repos/create":
                    return self._create_repo(json.loads(self._body()))
                if method == "POST" and path == "/api/validate-yaml":
                    self._body()
                    return self._json(200, {"errors": [], "warnings": []})
                if m := RESOLVE.match(path):
                    kind = {"datasets": "dataset", "spaces": "space", None: "model"}[m[1]]
                    return self._download(kind, m[2], unquote(m[3]), unquote(m[4]), head=method == "HEAD")
                if m := API.match(path):
                    return self._api(method, m[1][:-1], m[2], m[3], m[4] and unquote(m[4]), m[5] and unquote(m[5]))
            self._body()
            hub.unhandled.append(f"{method} {self.path}")
            self._not_found("EntryNotFound", f"fake hub: no route for {method} {path}", head=method == "HEAD")

        do_GET = lambda self: self._route("GET")  # noqa: E731
        do_HEAD = lambda self: self._route("HEAD")  # noqa: E731
        do_POST = lambda self: self._route("POST")  # noqa: E731
        do_DELETE = lambda self: self._route("DELETE")  # noqa: E731

        # -- endpoints
        def _create_repo(self, payload: dict):
            hub.create_payloads.append(payload)
            repo_type = payload.get("type") or "model"
            repo_id = f"{payload['organization']}/{payload['name']}"
            url = f"{hub.url}/{PREFIX[repo_type]}{repo_id}"
            if (repo_type, repo_id) in hub.repos:
                return self._json(409, {"error": "You already created this repo", "url": url})
            repo = Repo(repo_type, repo_id, private=payload.get("visibility") == "private", sdk=payload.get("sdk"))
            repo.commit("main", {".gitattributes": GITATTRIBUTES}, "initial commit")
            hub.repos[(repo_type, repo_id)] = repo
            return self._json(200, {"url": url, "name": repo_id})

        def _api(self, method, repo_type, repo_id, action, revision, rest):
            body = self._body() if method in ("POST", "DELETE") else b""
            repo = self._repo(repo_type, repo_id)
            if repo is None:
                return self._json(404, {"error": "Repository not found"}, "RepoNotFound")
            if action is None or action == "revision":  # repo_info / model_info / space_info
                sha = repo.resolve(revision or "main")
                if sha is None:
                    return self._json(404, {"error": f"Invalid rev id: {revision}"}, "RevisionNotFound")
                siblings = [{"rfilename": p, "size": len(c)} for p, c in sorted(repo.snapshots[sha].items())]
                return self._json(
                    200,
                    {
                        "id": repo_id,
                        "sha": sha,
                        "private": repo.private,
                        "sdk": repo.sdk,
                        "siblings": siblings,
                        "lastModified": _now(),
                    },
                )
            if action == "branch" and method == "POST":
                start = json.loads(body or b"{}").get("startingPoint") or "main"
                if revision in repo.branches:
                    return self._json(409, {"error": f"Branch {revision} already exists"})
                repo.branches[revision] = repo.resolve(start)
                return self._json(200, {})
            if action == "variables":
                if method == "POST":
                    var = json.loads(body)
                    repo.variables[var["key"]] = var["value"]
                elif method == "DELETE":
                    repo.variables.pop(json.loads(body)["key"], None)
                stamp = _now()
                return self._json(200, {k: {"value": v, "updatedAt": stamp} for k, v in repo.variables.items()})
            sha = repo.resolve(revision or "main")
            if sha is None:
                return self._json(404, {"error": f"Invalid rev id: {revision}"}, "RevisionNotFound")
            if action == "preupload":  # everything "regular": the content comes base64-encoded in the commit
                files = json.loads(body)["files"]
                return self._json(
                    200,
                    {
                        "files": [
                            {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": None}
                            for f in files
                        ]
                    },
                )
            if action == "commit":
                return self._commit(repo, revision, body)
            if action == "tree":
                prefix = (rest or "").strip("/")
                entries = [
                    {"type": "file", "path": p, "size": len(c), "oid": hashlib.sha1(c).hexdigest()}
                    for p, c in sorted(repo.snapshots[sha].items())
                    if not prefix or p.startswith(prefix + "/")
                ]
                if prefix and not entries:
                    return self._json(404, {"error": f"{prefix} does not exist"}, "EntryNotFound")
                return self._json(200, entries)
            hub.unhandled.append(f"{method} {self.path}")
            return self._json(404, {"error": "fake hub: unsupported"}, "EntryNotFound")

        def _commit(self, repo: Repo, branch: str, body: bytes):
            files = dict(repo.files(branch))
            summary = ""
            for line in body.decode().splitlines():
                item = json.loads(line)
                key, value = item["key"], item["value"]
                if key == "header":
                    summary = value["summary"]
                elif key == "file":
                    files[value["path"]] = base64.b64decode(value["content"])
                elif key == "deletedFile":
                    files.pop(value["path"], None)
                elif key == "deletedFolder":
                    files = {p: c for p, c in files.items() if not p.startswith(value["path"].rstrip("/") + "/")}
                else:  # lfsFile / copies: this fake never asks for them
                    return self._json(400, {"error": f"fake hub: unsupported commit operation {key}"})
            sha = repo.commit(branch, files, summary)
            url = f"{hub.url}/{PREFIX[repo.repo_type]}{repo.repo_id}/commit/{sha}"
            return self._json(200, {"success": True, "commitOid": sha, "commitUrl": url})

        def _download(self, repo_type, repo_id, revision, filename, head):
            repo = self._repo(repo_type, repo_id)
            if repo is None:
                return self._not_found("RepoNotFound", "Repository not found", head)
            sha = repo.resolve(revision)
            if sha is None:
                return self._not_found("RevisionNotFound", f"Invalid rev id: {revision}", head)
            content = repo.snapshots[sha].get(filename)
            if content is None:
                return self._not_found("EntryNotFound", f"{filename} does not exist at {revision}", head)
            etag = f'"{hashlib.sha1(content).hexdigest()}"'
            self._send(
                200, content, {"X-Repo-Commit": sha, "ETag": etag, "Content-Type": "application/octet-stream"}, head
            )

    return Handler
