"""A local Hub-compatible HTTP server, to try a push without a Hub account (the tests' `hub` fixture uses it):
what huggingface_hub and transformers need to create, commit to and read repositories, in memory (Ctrl-C stops it):
    python -m hf_dp_repr.hub.local_server --port 8000
    HF_ENDPOINT=http://127.0.0.1:8000 HF_TOKEN=hf_write_someone hf-dp-repr push out/run --hub_model_id someone/dp-run
What it speaks, as huggingface.co does (huggingface_hub's hf_api.py, _commit_api.py, file_download.py): `TOKENS`
(else 401), `whoami-v2`, `repos/create`, `validate-yaml`; per model or dataset repository ("datasets/{id}" in
`repos`): `preupload` (files "regular"), the NDJSON `commit`, `tree`, `refs`, `branch`, its info, `HEAD`/`GET
.../resolve/{rev}/{path}` (`X-Repo-Commit`, `ETag`). Private repositories: anonymous reads 401, other users 404
(`RepoNotFound`); writes need a write token of the owner or of a member of its org with write role, else 403.
Commits are snapshots (path -> bytes), sha1 ids, the first with the Hub's `.gitattributes`. A request it does not
know (501) or cannot read (500) is recorded in `unknown` (the `hub` fixture fails on it).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

# token -> who holds it. "scoped": fine-grained write access to these namespaces / repositories only.
TOKENS = {
    "hf_write_someone": {"user": "someone", "role": "write"},
    "hf_read_someone": {"user": "someone", "role": "read"},
    "hf_scoped_someone": {"user": "someone", "role": "fineGrained", "scoped": ["someone/allowed"]},
    "hf_write_other": {"user": "other", "role": "write"},
}
ORGS = {"dp-lab": {"someone": "write"}, "readers": {"someone": "read"}}  # org -> member -> role in org
GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.bin filter=lfs diff=lfs merge=lfs -text\n"
INVALID_TOKEN = "Invalid credentials in Authorization header"


def git_blob_id(data: bytes) -> str:
    """The git object id of a file, as the Hub reports it for regular (non-LFS) files."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Commit:
    oid: str
    title: str
    files: dict[str, bytes]  # the whole snapshot after this commit
    changed: list[str]  # paths added or modified by it (sorted)


@dataclass
class Repo:
    id: str
    private: bool
    commits: list[Commit] = field(default_factory=list)  # oldest first
    branches: dict[str, str] = field(default_factory=dict)  # name -> commit oid

    def commit(self, oid_or_branch: str) -> Commit | None:
        oid = self.branches.get(oid_or_branch, oid_or_branch)
        return next((c for c in self.commits if len(oid) >= 7 and c.oid.startswith(oid)), None)

    @property
    def files(self) -> dict[str, bytes]:
        """The files on main."""
        return self.commit("main").files


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None, **body):
        super().__init__(message)
        self.status, self.message, self.code, self.headers, self.body = status, message, code, headers or {}, body


class LocalHub:
    """The server's state (repositories, requests seen) and its thread."""

    def __init__(self):
        self.lock = threading.Lock()
        self.reset()
        self.httpd = None

    def reset(self) -> None:
        with self.lock:
            self.repos: dict[str, Repo] = {}
            self.requests: list[tuple[str, str, str | None]] = []  # (method, path, user) of every request
            self.unknown: list[str] = []
            self.hold_uploads: threading.Event | None = None  # if set: each preupload waits for it (at most 2 s)

    def start(self, port: int = 0) -> "LocalHub":
        """Serve on 127.0.0.1:`port` (0: a free port) in a daemon thread; `url` is its address."""
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.hub = self
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def calls(self, method: str, pattern: str) -> list[tuple[str, str, str | None]]:
        """The requests seen whose method is `method` and whose path matches the regex `pattern`."""
        return [r for r in self.requests if r[0] == method and re.search(pattern, r[1])]

    def pushes(self, repo_id: str) -> list[list[str]]:
        """The files of `repo_id` after each commit but the first (the Hub's own, with `.gitattributes`): what
        each push left there, sorted."""
        return [sorted(set(c.files) - {".gitattributes"}) for c in self.repos[repo_id].commits[1:]]

    # ---- repositories and commits ------------------------------------------------------------------------------
    def create_repo(self, repo_id: str, private: bool = False) -> Repo:
        repo = Repo(repo_id, private)
        self.repos[repo_id] = repo
        self._commit(repo, "main", "initial commit", {".gitattributes": GITATTRIBUTES})
        return repo

    def _commit(self, repo: Repo, branch: str, title: str, changes: dict[str, bytes | None]) -> Commit:
        parent = repo.commit(branch)
        files = dict(parent.files) if parent else {}
        for path, data in changes.items():
            if data is None:  # a deletion: the file, or everything under the folder
                files = {p: d for p, d in files.items() if p != path and not p.startswith(path.rstrip("/") + "/")}
            else:
                files[path] = data
        seed = json.dumps([parent.oid if parent else None, title, len(repo.commits),
                           {p: git_blob_id(d) for p, d in sorted(files.items())}])
        commit = Commit(hashlib.sha1(seed.encode()).hexdigest(), title, files, sorted(changes))
        repo.commits.append(commit)
        repo.branches[branch] = commit.oid
        return commit


# ---- access ---------------------------------------------------------------------------------------------------------
def _writable_namespaces(token: dict) -> list[str]:
    user = token["user"]
    return [user] + [org for org, members in ORGS.items() if members.get(user) in ("write", "admin")]


def _may_write(token: dict | None, repo_id: str) -> bool:
    if token is None or token["role"] == "read":
        return False
    repo_id = repo_id.removeprefix(DATASETS)
    namespace = repo_id.split("/")[0]
    if token["role"] == "fineGrained":
        return any(scope in (namespace, repo_id) for scope in token["scoped"])
    return namespace in _writable_namespaces(token)


def _may_read(token: dict | None, repo: Repo) -> bool:
    if not repo.private:
        return True
    namespace = repo.id.removeprefix(DATASETS).split("/")[0]
    return token is not None and (namespace == token["user"] or token["user"] in ORGS.get(namespace, {}))


def _whoami(token: dict) -> dict:
    user = token["user"]
    orgs = [{"type": "org", "name": org, "roleInOrg": members[user]} for org, members in ORGS.items()
            if user in members]
    access = {"displayName": "test token", "role": token["role"]}
    if token["role"] == "fineGrained":
        scoped = [{"entity": {"type": "model" if "/" in s else "user", "name": s},
                   "permissions": ["repo.content.read", "repo.write"]} for s in token["scoped"]]
        access["fineGrained"] = {"global": [], "scoped": scoped}
    return {"type": "user", "id": user, "name": user, "fullname": user, "orgs": orgs,
            "auth": {"type": "access_token", "accessToken": access}}


# ---- HTTP ---------------------------------------------------------------------------------------------------------
DATASETS = "datasets/"  # a dataset repository's key in LocalHub.repos: "datasets/owner/name" (models: "owner/name")
REPO = r"/api/(?P<kind>models|datasets)/(?P<repo>[^/]+/[^/]+)"
ROUTES = [  # (method, path regex, handler name)
    ("GET", r"/api/whoami-v2", "whoami"),
    ("POST", r"/api/repos/create", "create_repo"),
    ("POST", r"/api/validate-yaml", "validate_yaml"),
    ("GET", REPO + r"(?:/revision/(?P<rev>[^/]+))?", "model_info"),
    ("POST", REPO + r"/preupload/(?P<rev>[^/]+)", "preupload"),
    ("POST", REPO + r"/commit/(?P<rev>[^/]+)", "commit"),
    ("GET", REPO + r"/tree/(?P<rev>[^/]+)(?:/(?P<path>.+))?", "tree"),
    ("GET", REPO + r"/refs", "refs"),
    ("POST", REPO + r"/branch/(?P<branch>[^/]+)", "create_branch"),
    ("GET", r"/(?:(?P<kind>datasets)/)?(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)", "resolve"),
    ("HEAD", r"/(?:(?P<kind>datasets)/)?(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)", "resolve"),
]


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    def log_message(self, *args):  # quiet: every request is recorded in LocalHub.requests
        pass

    def _dispatch(self, method: str) -> None:
        hub: LocalHub = self.server.hub
        url = urlsplit(self.path)
        self.query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        size = int(self.headers.get("Content-Length") or 0)
        self.body = self.rfile.read(size) if size else b""
        auth = self.headers.get("Authorization") or ""
        secret = auth[len("Bearer "):] if auth.startswith("Bearer ") else None
        self.token = TOKENS.get(secret) if secret else None
        with hub.lock:
            hub.requests.append((method, url.path, self.token and self.token["user"]))
        name, match = next(((name, m) for verb, pattern, name in ROUTES
                            if verb == method and (m := re.fullmatch(pattern, url.path))), (None, None))
        if name is None:
            with hub.lock:
                hub.unknown.append(f"{method} {self.path}")
            return self._send(501, {"error": f"the test Hub does not serve {method} {url.path}"})
        if name == "preupload" and hub.hold_uploads is not None:  # a slow Hub: training goes on meanwhile
            hub.hold_uploads.wait(timeout=2)
        try:
            if secret and self.token is None:
                raise HubError(401, INVALID_TOKEN)
            args = {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
            if args.pop("kind", None) == "datasets":
                args["repo"] = DATASETS + args["repo"]
            with hub.lock:
                status, payload, headers = getattr(self, name)(hub, **args)
        except HubError as err:
            headers = {"X-Error-Message": err.message, **err.headers}
            if err.code:
                headers["X-Error-Code"] = err.code
            return self._send(err.status, {"error": err.message, **err.body}, headers, head=method == "HEAD")
        except Exception as err:  # a request the server misreads: the fixture reports it after the test
            with hub.lock:
                hub.unknown.append(f"{method} {self.path}: {type(err).__name__}: {err}")
            return self._send(500, {"error": f"test Hub error: {err!r}"})
        self._send(status, payload, headers, head=method == "HEAD")

    def _send(self, status: int, payload, headers: dict | None = None, head: bool = False) -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream" if isinstance(payload, bytes)
                         else "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if not head:
            self.wfile.write(data)

    # ---- helpers ---------------------------------------------------------------------------------------------
    def _json(self):
        return json.loads(self.body or b"{}")

    def _readable(self, hub: LocalHub, repo_id: str) -> Repo:
        repo = hub.repos.get(repo_id)
        if repo is None or not _may_read(self.token, repo):  # a private repo is not there for others
            raise HubError(401 if self.token is None else 404, "Repository not found", "RepoNotFound")
        return repo

    def _writable(self, hub: LocalHub, repo_id: str) -> Repo:
        repo = self._readable(hub, repo_id)
        if not _may_write(self.token, repo_id):
            raise HubError(403, f"You don't have write access to {repo_id}")
        return repo

    @staticmethod
    def _revision(repo: Repo, rev: str) -> Commit:
        commit = repo.commit(rev)
        if commit is None:
            raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        return commit

    def _url(self, hub: LocalHub, repo_id: str) -> str:
        return f"{hub.url}/{repo_id}"

    # ---- endpoints: each returns (status, JSON payload or bytes, headers) -----------------------------------
    def whoami(self, hub):
        if self.token is None:
            raise HubError(401, INVALID_TOKEN)
        return 200, _whoami(self.token), {}

    def create_repo(self, hub):
        body = self._json()
        if body.get("type", "model") not in ("model", "dataset"):
            raise HubError(400, "the test Hub hosts model and dataset repositories only")
        prefix = DATASETS if body.get("type") == "dataset" else ""
        if self.token is None:
            raise HubError(401, INVALID_TOKEN)
        namespace = body.get("organization") or self.token["user"]
        repo_id = f"{namespace}/{body['name']}"
        if not _may_write(self.token, repo_id):
            raise HubError(403, f'You don\'t have the rights to create a model under the namespace "{namespace}"')
        if prefix + repo_id in hub.repos:
            raise HubError(409, "You already created this model repo", url=self._url(hub, prefix + repo_id))
        private = body.get("visibility", "private" if body.get("private") else "public") == "private"
        hub.create_repo(prefix + repo_id, private)
        return 200, {"url": self._url(hub, prefix + repo_id), "name": repo_id, "id": repo_id}, {}

    def validate_yaml(self, hub):
        content = self._json().get("content", "")
        match = re.match(r"^---\n(.*?)\n---\n", content, re.S)
        if match is None:
            return 200, {"errors": [], "warnings": [{"message": "empty or missing yaml metadata in repo card"}]}, {}
        try:
            metadata = yaml.safe_load(match.group(1))
        except yaml.YAMLError as err:
            return 400, {"errors": [{"message": f"Invalid YAML: {err}"}], "warnings": []}, {}
        errors = [] if isinstance(metadata, dict) else ["metadata must be a mapping"]
        if isinstance(metadata, dict) and not all(isinstance(t, str) for t in metadata.get("tags", [])):
            errors.append('"tags" must be a list of strings')
        return (400 if errors else 200), {"errors": [{"message": e} for e in errors], "warnings": []}, {}

    def model_info(self, hub, repo, rev="main"):
        repo_ = self._readable(hub, repo)
        commit = self._revision(repo_, rev)
        return 200, {"id": repo, "author": repo.split("/")[0], "sha": commit.oid, "private": repo_.private,
                     "siblings": [{"rfilename": p} for p in sorted(commit.files)], "tags": []}, {}

    def preupload(self, hub, repo, rev):
        commit = self._revision(self._writable(hub, repo), rev)
        files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                  "oid": git_blob_id(commit.files[f["path"]]) if f["path"] in commit.files else None}
                 for f in self._json()["files"]]
        return 200, {"files": files, "commitOid": commit.oid}, {}

    def commit(self, hub, repo, rev):
        repo_ = self._writable(hub, repo)
        head = self._revision(repo_, rev)
        if rev not in repo_.branches or "create_pr" in self.query:
            raise HubError(400, f"the test Hub commits to branches only, not to {rev!r}")
        lines = [json.loads(line) for line in self.body.decode().splitlines() if line.strip()]
        header = lines[0]["value"]
        if header.get("parentCommit") and not head.oid.startswith(header["parentCommit"]):
            raise HubError(412, "A commit has happened since. Please refresh and try again.")
        changes = {}
        for line in lines[1:]:
            key, value = line["key"], line["value"]
            if key == "file":
                changes[value["path"]] = base64.b64decode(value["content"])
            elif key in ("deletedFile", "deletedFolder"):
                changes[value["path"]] = None
            else:  # lfsFile: the preupload answer said "regular" for every file
                raise HubError(400, f"the test Hub takes regular uploads only, not {key}")
        new = hub._commit(repo_, rev, header["summary"], changes)
        return 200, {"success": True, "commitOid": new.oid, "commitUrl": f"{self._url(hub, repo)}/commit/{new.oid}"}, {}

    def tree(self, hub, repo, rev, path=""):
        commit = self._revision(self._readable(hub, repo), rev)
        prefix = path.rstrip("/") + "/" if path else ""
        recursive = self.query.get("recursive", "false").lower() == "true"
        entries, folders = [], set()
        for name, data in sorted(commit.files.items()):
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix):]
            if "/" in rest and not recursive:
                folders.add(prefix + rest.split("/")[0])
                continue
            entries.append({"type": "file", "path": name, "oid": git_blob_id(data), "size": len(data)})
        entries += [{"type": "directory", "path": f, "oid": hashlib.sha1(f.encode()).hexdigest()} for f in
                    sorted(folders)]
        if path and not entries:
            raise HubError(404, f"{path} does not exist on {rev}", "EntryNotFound")
        return 200, entries, {}

    def refs(self, hub, repo):
        repo_ = self._readable(hub, repo)
        branches = [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": oid} for b, oid in repo_.branches.items()]
        return 200, {"branches": branches, "tags": [], "converts": []}, {}

    def create_branch(self, hub, repo, branch):
        repo_ = self._writable(hub, repo)
        if branch in repo_.branches:
            raise HubError(409, f"Reference refs/heads/{branch} already exists")
        repo_.branches[branch] = self._revision(repo_, self._json().get("startingPoint") or "main").oid
        return 200, {}, {}

    def resolve(self, hub, repo, rev, path):
        commit = self._revision(self._readable(hub, repo), rev)
        if path not in commit.files:
            raise HubError(404, "Entry not found", "EntryNotFound", {"X-Repo-Commit": commit.oid})
        data = commit.files[path]
        return 200, data, {"X-Repo-Commit": commit.oid, "ETag": f'"{git_blob_id(data)}"'}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hf_dp_repr.hub.local_server", description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=8000, help="port on 127.0.0.1 (0: any free port)")
    hub = LocalHub().start(parser.parse_args(argv).port)
    print(f"local Hub at {hub.url}: HF_ENDPOINT={hub.url}, tokens {', '.join(TOKENS)}; Ctrl-C stops it", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        threading.Event().wait()


if __name__ == "__main__":
    main()
