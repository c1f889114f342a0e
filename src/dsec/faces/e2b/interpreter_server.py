"""The code interpreter server that runs inside sandboxes of the ``code-interpreter-v1``
template: the HTTP protocol the ``e2b-code-interpreter`` SDK speaks, over Jupyter kernels
(jupyter_client + ipykernel, installed in the template's layer).

Not imported by dsec: the template's layer carries this file and the sandbox runs it
(``python3 interpreter_server.py --port 49999``) as the template's user. Stdlib and
jupyter_client only.

- ``POST /execute`` {code, context_id | language, env_vars}: the cell's output as lines of
  JSON, each written as the kernel produces it: ``stdout``/``stderr`` {text, timestamp},
  ``result`` {text, html, markdown, svg, png, jpeg, pdf, latex, json, javascript, extra,
  is_main_result}, ``error`` {name, value, traceback}, ``number_of_executions``
  {execution_count}, then ``end_of_execution``. Cells of one context run one at a time.
- ``POST /contexts`` {language, cwd} -> {id, language, cwd}; ``GET /contexts``;
  ``DELETE /contexts/{id}``; ``POST /contexts/{id}/restart``.
- ``GET /health``.
Python is the one language offered; others are refused with 400.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from jupyter_client.manager import KernelManager

MIME_FIELDS = {"text/plain": "text", "text/html": "html", "text/markdown": "markdown", "image/svg+xml": "svg",
               "image/png": "png", "image/jpeg": "jpeg", "application/pdf": "pdf", "text/latex": "latex",
               "application/json": "json", "application/javascript": "javascript"}
LANGUAGES = {"python": "python3"}


class Context:
    """One kernel: its cells run in order, each streaming its output to its caller."""

    def __init__(self, language: str, cwd: str) -> None:
        self.id, self.language, self.cwd = uuid.uuid4().hex, language, cwd
        self.lock = threading.Lock()
        self.km = KernelManager(kernel_name=LANGUAGES[language])
        self.km.start_kernel(cwd=cwd)
        self.kc = self.km.blocking_client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def info(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    def restart(self) -> None:
        with self.lock:
            self.km.restart_kernel(now=True)
            self.kc.wait_for_ready(timeout=60)

    def shutdown(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)

    def execute(self, code: str, env_vars: dict[str, str], emit: Any) -> None:
        with self.lock:
            if env_vars:  # for this cell only, as E2B scopes them
                self._run_silently(f"import os as __e; __saved = {{k: __e.environ.get(k) for k in {list(env_vars)!r}}};"
                                   f" __e.environ.update({env_vars!r})")
            try:
                self._execute(code, emit)
            finally:
                if env_vars:
                    self._run_silently("[__e.environ.pop(k, None) if v is None else __e.environ.__setitem__(k, v)"
                                       " for k, v in __saved.items()]")
        emit({"type": "end_of_execution"})

    def _run_silently(self, code: str) -> None:
        msg_id = self.kc.execute(code, silent=True, store_history=False)
        self._drain(msg_id, lambda _: None)

    def _execute(self, code: str, emit: Any) -> None:
        msg_id = self.kc.execute(code, store_history=True, allow_stdin=False)

        def on(msg: dict[str, Any]) -> None:
            kind, content = msg["msg_type"], msg["content"]
            now = int(time.time() * 1e6)
            if kind == "stream":
                emit({"type": "stdout" if content["name"] == "stdout" else "stderr", "text": content["text"],
                      "timestamp": now})
            elif kind in ("execute_result", "display_data"):
                out: dict[str, Any] = {"type": "result", "is_main_result": kind == "execute_result"}
                extra = {}
                for mime, value in content.get("data", {}).items():
                    if mime in MIME_FIELDS:
                        out[MIME_FIELDS[mime]] = value
                    else:
                        extra[mime] = value
                if extra:
                    out["extra"] = extra
                emit(out)
            elif kind == "error":
                emit({"type": "error", "name": content["ename"], "value": content["evalue"],
                      "traceback": "\n".join(content["traceback"])})
            elif kind == "execute_input":
                emit({"type": "number_of_executions", "execution_count": content["execution_count"]})
        self._drain(msg_id, on)

    def _drain(self, msg_id: str, on: Any) -> None:
        while True:
            msg = self.kc.get_iopub_msg(timeout=None)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                return
            on(msg)


class Interpreter:
    def __init__(self, cwd: str) -> None:
        self.cwd = cwd
        self.contexts: dict[str, Context] = {}
        self.defaults: dict[str, str] = {}  # language -> its default context
        self.lock = threading.Lock()

    def create(self, language: str, cwd: str | None) -> Context:
        if language not in LANGUAGES:
            raise ValueError(f"language {language!r} is not offered here (only {sorted(LANGUAGES)})")
        ctx = Context(language, cwd or self.cwd)
        with self.lock:
            self.contexts[ctx.id] = ctx
        return ctx

    def default(self, language: str) -> Context:
        with self.lock:
            found = self.contexts.get(self.defaults.get(language, ""))
        if found is None:
            found = self.create(language, None)
            with self.lock:
                self.defaults[language] = found.id
        return found


class Handler(BaseHTTPRequestHandler):
    interpreter: Interpreter
    protocol_version = "HTTP/1.0"  # a streamed body ends when the connection does

    def log_message(self, format: str, *args: Any) -> None:
        return

    def _json(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict[str, Any]:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b"{}"
        body = json.loads(raw or b"{}")
        if not isinstance(body, dict):
            raise ValueError("the request body is not a JSON object")
        return body

    def _context(self, cid: str) -> Context | None:
        return self.interpreter.contexts.get(cid)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._json(200, {"status": "ok"})
        elif self.path == "/contexts":
            self._json(200, [c.info() for c in list(self.interpreter.contexts.values())])
        else:
            self._json(404, {"message": f"no route {self.path}"})

    def do_DELETE(self) -> None:
        ctx = self._context(self.path.removeprefix("/contexts/"))
        if not self.path.startswith("/contexts/") or ctx is None:
            self._json(404, {"message": f"context {self.path.removeprefix('/contexts/')!r} not found"})
            return
        self.interpreter.contexts.pop(ctx.id, None)
        ctx.shutdown()
        self.send_response(204)
        self.end_headers()

    def do_POST(self) -> None:
        try:
            body = self._body()
        except ValueError as e:
            self._json(400, {"message": str(e)})
            return
        if self.path == "/contexts":
            try:
                self._json(200, self.interpreter.create(body.get("language") or "python", body.get("cwd")).info())
            except ValueError as e:
                self._json(400, {"message": str(e)})
        elif self.path.startswith("/contexts/") and self.path.endswith("/restart"):
            ctx = self._context(self.path.removeprefix("/contexts/").removesuffix("/restart"))
            if ctx is None:
                self._json(404, {"message": "context not found"})
                return
            ctx.restart()
            self._json(200, {})
        elif self.path == "/execute":
            self._execute(body)
        else:
            self._json(404, {"message": f"no route {self.path}"})

    def _execute(self, body: dict[str, Any]) -> None:
        if body.get("context_id"):
            ctx = self._context(body["context_id"])
            if ctx is None:
                self._json(404, {"message": f"context {body['context_id']!r} not found"})
                return
        else:
            try:
                ctx = self.interpreter.default(body.get("language") or "python")
            except ValueError as e:
                self._json(400, {"message": str(e)})
                return
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.end_headers()
        lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        runner = threading.Thread(target=self._run, args=(ctx, body, lines), daemon=True)
        runner.start()
        while (item := lines.get()) is not None:
            try:
                self.wfile.write(json.dumps(item).encode() + b"\n")
                self.wfile.flush()
            except OSError:  # the caller left: the cell runs on, its output is dropped
                return

    @staticmethod
    def _run(ctx: Context, body: dict[str, Any], lines: queue.Queue[dict[str, Any] | None]) -> None:
        try:
            ctx.execute(str(body.get("code", "")), dict(body.get("env_vars") or {}), lines.put)
        except Exception as e:  # the kernel died under the cell
            lines.put({"type": "error", "name": type(e).__name__, "value": str(e), "traceback": ""})
            lines.put({"type": "end_of_execution"})
        finally:
            lines.put(None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=49999)
    a = ap.parse_args()
    Handler.interpreter = Interpreter(os.environ.get("HOME", "/"))
    Handler.interpreter.default("python")  # warm: the first cell does not wait for a kernel
    ThreadingHTTPServer(("127.0.0.1", a.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
