"""A FAKE Kubernetes API server: just `coordination.k8s.io/v1` Leases, over HTTP on 127.0.0.1.

No real API server can be installed here (no kube-apiserver package, no network to fetch one, no
container runtime for kind), so this stands in for one in the tests of `leadership = "kubernetes"`
(tests/fleet/test_kubernetes.py) and in `python -m bench.takeover --backend kubernetes`. It does
what the API server does for the calls ckptd makes, and nothing else:

- GET `/apis/coordination.k8s.io/v1/namespaces/<ns>/leases/<name>`: the Lease, or 404 NotFound.
- POST `.../namespaces/<ns>/leases`: created, with a new `resourceVersion`; 409 AlreadyExists if
  that name exists.
- PUT `.../leases/<name>`: replaced only if the body's `metadata.resourceVersion` is the stored
  one (422 Invalid without one: a Lease's strategy allows no unconditional update), else 409
  Conflict; 404 where there is none. Every write takes the next `resourceVersion` (one counter for
  the whole store, as etcd's revision is).
- The body is checked as the API server would refuse it: `kind`/`apiVersion`, the name in the
  URL, MicroTimes in RFC3339 with exactly six fraction digits (apimachinery's RFC3339Micro),
  non-negative integers (400 BadRequest, 422 Invalid). A bearer token is required (401).
- Errors are `Status` objects, as the API server sends them (lightkube parses them).

It runs as its own process (`python -m tests.support.fakekube --port P --state FILE --token T`,
the port on its first line of output), so that a test can SIGSTOP it (requests hang: a partition),
kill it (connections refused) and start it again on the same port and store (the store, like
etcd's data, survives: `--state` is written through, atomically, at every write).

Not here: watches, lists, label selectors, PATCH, DELETE, TLS, RBAC, admission, managedFields.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import uuid
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

PREFIX = "/apis/coordination.k8s.io/v1/namespaces/"
MICRO = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}(Z|[+-]\d\d:\d\d)")
TIME_FIELDS = ("acquireTime", "renewTime")


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


class Store:
    def __init__(self, path: Path):
        self.path = path
        self.lock = threading.Lock()
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            doc = {"rv": 0, "leases": {}, "requests": {}}
        self.rv, self.leases, self.requests = doc["rv"], doc["leases"], doc.get("requests", {})

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"rv": self.rv, "leases": self.leases, "requests": self.requests}))
        os.replace(tmp, self.path)


def check_body(body: Any, ns: str, name: str | None) -> tuple[int, dict[str, Any]] | None:
    """What the API server refuses in a Lease sent to it, or None."""
    if not isinstance(body, dict) or body.get("kind") != "Lease" or body.get("apiVersion") != "coordination.k8s.io/v1":
        return 400, status(400, "BadRequest", "the body is not a coordination.k8s.io/v1 Lease")
    meta = body.get("metadata") or {}
    if meta.get("namespace") not in (None, ns):
        return 400, status(400, "BadRequest", "the namespace of the provided object does not match the namespace "
                                              "sent on the request")
    if name is not None and meta.get("name") != name:
        return 400, status(400, "BadRequest", "the name of the object does not match the name on the URL")
    spec = body.get("spec") or {}
    for key in TIME_FIELDS:
        value = spec.get(key)
        if value is not None and not (isinstance(value, str) and MICRO.fullmatch(value)):
            return 400, status(400, "BadRequest", f'parsing time "{value}" as "2006-01-02T15:04:05.000000Z07:00": '
                                                  "cannot parse")
    for key in ("leaseDurationSeconds", "leaseTransitions"):
        value = spec.get(key)
        if value is not None and (not isinstance(value, int) or value < 0 or (key == "leaseDurationSeconds"
                                                                              and value == 0)):
            return 422, status(422, "Invalid", f"Lease.coordination.k8s.io \"{meta.get('name')}\" is invalid: "
                                               f"spec.{key}: Invalid value: {value!r}")
    return None


class Handler(BaseHTTPRequestHandler):
    server: Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, code: int, doc: dict[str, Any]) -> None:
        raw = json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _route(self) -> tuple[str, str | None] | None:
        path = self.path.split("?", 1)[0]
        if not path.startswith(PREFIX):
            return None
        parts = path[len(PREFIX):].split("/")
        if len(parts) == 2 and parts[1] == "leases":
            return parts[0], None
        if len(parts) == 3 and parts[1] == "leases" and parts[2]:
            return parts[0], parts[2]
        return None

    def _handle(self, method: str) -> None:
        store = self.server.store
        with store.lock:
            store.requests[method] = store.requests.get(method, 0) + 1
        if self.headers.get("Authorization") != f"Bearer {self.server.token}":
            self._send(401, status(401, "Unauthorized", "Unauthorized"))
            return
        route = self._route()
        if route is None or (method == "POST") != (route[1] is None):
            self._send(404, status(404, "NotFound", "the server could not find the requested resource"))
            return
        ns, name = route
        body = None
        if method in ("POST", "PUT"):
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            except ValueError:
                self._send(400, status(400, "BadRequest", "the body is not JSON"))
                return
            if (refused := check_body(body, ns, name)) is not None:
                self._send(*refused)
                return
        with store.lock:
            code, doc = getattr(self, f"_{method.lower()}")(store, ns, name, body)
            if code in (200, 201):
                store.save()
        self._send(code, doc)

    def _get(self, store: Store, ns: str, name: str, body: Any) -> tuple[int, dict[str, Any]]:
        lease = store.leases.get(f"{ns}/{name}")
        if lease is None:
            return 404, status(404, "NotFound", f'leases.coordination.k8s.io "{name}" not found')
        return 200, lease

    def _post(self, store: Store, ns: str, name: None, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        name = (body.get("metadata") or {}).get("name")
        if not name:
            return 422, status(422, "Invalid", "metadata.name: Required value")
        if f"{ns}/{name}" in store.leases:
            return 409, status(409, "AlreadyExists", f'leases.coordination.k8s.io "{name}" already exists')
        store.rv += 1
        meta = {**body.get("metadata", {}), "name": name, "namespace": ns, "resourceVersion": str(store.rv),
                "uid": str(uuid.uuid4()), "creationTimestamp": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
        store.leases[f"{ns}/{name}"] = lease = {**body, "metadata": meta}
        return 201, lease

    def _put(self, store: Store, ns: str, name: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        old = store.leases.get(f"{ns}/{name}")
        if old is None:
            return 404, status(404, "NotFound", f'leases.coordination.k8s.io "{name}" not found')
        rv = (body.get("metadata") or {}).get("resourceVersion")
        if not rv:
            return 422, status(422, "Invalid", f'Lease.coordination.k8s.io "{name}" is invalid: '
                                               "metadata.resourceVersion: Invalid value: 0x0: must be specified for an update")
        if rv != old["metadata"]["resourceVersion"]:
            return 409, status(409, "Conflict", f'Operation cannot be fulfilled on leases.coordination.k8s.io "{name}": '
                                                "the object has been modified; please apply your changes to the "
                                                "latest version and try again")
        store.rv += 1
        meta = {**body["metadata"], "namespace": ns, "resourceVersion": str(store.rv), "uid": old["metadata"]["uid"],
                "creationTimestamp": old["metadata"]["creationTimestamp"]}
        store.leases[f"{ns}/{name}"] = lease = {**body, "metadata": meta}
        return 200, lease

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_DELETE(self) -> None:
        self._send(405, status(405, "MethodNotAllowed", "not in this fake"))


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, port: int, store: Store, token: str):
        super().__init__(("127.0.0.1", port), Handler)
        self.store, self.token = store, token


class FakeKube:
    """The fake API server as a child process, and a kubeconfig that names it."""

    def __init__(self, workdir: Path, token: str = "fake-token", namespace: str = "ckptd-test"):
        self.workdir = workdir
        self.state = workdir / "store.json"
        self.token = token
        self.namespace = namespace
        self.port = 0
        self.proc: subprocess.Popen[str] | None = None
        self.kubeconfig = workdir / "kubeconfig"

    def start(self) -> None:
        repo = Path(__file__).resolve().parents[2]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.fakekube", "--port", str(self.port), "--state", str(self.state),
             "--token", self.token],
            cwd=repo, stdout=subprocess.PIPE, text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # the port, once it listens (bounded by the child: it binds or exits)
        if not line.strip().isdigit():
            self.proc.kill()
            raise RuntimeError(f"the fake API server did not start: {line!r}")
        self.port = int(line)
        self.kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: fake\n"
            f"clusters:\n- name: fake\n  cluster:\n    server: {self.url}\n"
            f"users:\n- name: ckptd\n  user:\n    token: {self.token}\n"
            f"contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: ckptd\n    namespace: {self.namespace}\n"
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()

    def store(self) -> dict[str, Any]:
        """What the server holds, as it last wrote it."""
        try:
            return json.loads(self.state.read_text())
        except FileNotFoundError:
            return {"rv": 0, "leases": {}, "requests": {}}

    def lease(self, name: str) -> dict[str, Any] | None:
        return self.store()["leases"].get(f"{self.namespace}/{name}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.support.fakekube")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--state", type=Path, required=True)
    p.add_argument("--token", default="fake-token")
    args = p.parse_args(argv)
    server = Server(args.port, Store(args.state), args.token)
    print(server.server_address[1], flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
