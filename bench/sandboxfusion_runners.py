"""SandboxFusion's own runner tests (``sandbox/tests/runners`` of its repository, unmodified)
against dsec's SandboxFusion face.

Their tests post to ``/run_code`` through a ``TestClient(app)`` of SandboxFusion's server;
here a stand-in ``sandbox`` package (written to a temporary dir, never into dsec) gives them
an ``app`` that forwards each request to dsec's ``/sandboxfusion/<token>/`` and dsec's own
wire models under SandboxFusion's import paths. The tests themselves are read from the
checkout given, copied to that temporary dir, and run with pytest; the counts per file are
printed (and written to a JSON file with ``--json``).

    .venv/bin/python bench/sandboxfusion_runners.py SANDBOXFUSION_CHECKOUT [--url URL --token T]

Without ``--url`` a private server is started on this node's layers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.append(os.path.dirname(os.path.abspath(__file__)))

from container import private_server  # noqa: E402

from dsec.faces.embedded import data_dir_default  # noqa: E402

STAND_IN = {
    "sandbox/__init__.py": "",
    "sandbox/runners/__init__.py": "from dsec.faces.sandboxfusion.models import CommandRunStatus  # noqa: F401\n",
    "sandbox/server/__init__.py": "",
    "sandbox/server/sandbox_api.py":
        "from dsec.faces.sandboxfusion.models import RunCodeRequest, RunCodeResponse, RunStatus  # noqa: F401\n",
    # an ASGI app forwarding every request to dsec's face (TestClient drives it in-process)
    "sandbox/server/server.py": '''import os

import httpx

BASE = os.environ["DSEC_SF_BASE"]


async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    async with httpx.AsyncClient(timeout=300) as c:
        r = await c.request(scope["method"], BASE + scope["path"], content=body,
                            headers={"content-type": "application/json"})
    await send({"type": "http.response.start", "status": r.status_code,
                "headers": [(b"content-type", r.headers.get("content-type", "application/json").encode())]})
    await send({"type": "http.response.body", "body": r.content})
''',
    "pytest.ini": "[pytest]\nmarkers =\n    minor\n    cuda\n    jupyter\n",
}


def run(checkout: str, url: str, token: str, only: list[str] | None = None) -> dict[str, dict[str, int]]:
    src = os.path.join(checkout, "sandbox", "tests", "runners")
    work = tempfile.mkdtemp(prefix="dsec-sf-runners-")
    try:
        for rel, text in STAND_IN.items():
            path = os.path.join(work, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
        shutil.copytree(src, os.path.join(work, "runners"), ignore=lambda d, names: [
            n for n in names if only and n.startswith("test_") and n.removesuffix(".py") not in only])
        report = os.path.join(work, "report.txt")
        env = {**os.environ, "DSEC_SF_BASE": f"{url}/sandboxfusion/{token}",
               "PYTHONPATH": os.pathsep.join([work, *os.environ.get("PYTHONPATH", "").split(os.pathsep)])}
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "runners",
                        "--continue-on-collection-errors",
                        "-o", "console_output_style=classic"], cwd=work, env=env,
                       stdout=open(report, "w"), stderr=subprocess.STDOUT)  # noqa: SIM115
        if os.environ.get("DSEC_SF_REPORT"):
            shutil.copy(report, os.environ["DSEC_SF_REPORT"])
        counts: dict[str, dict[str, int]] = {}
        with open(report) as f:
            for line in f:
                m = re.match(r"^(PASSED|FAILED|ERROR|SKIPPED) runners/(\w+)\.py", line)
                if m:
                    per = counts.setdefault(m.group(2), {})
                    per[m.group(1).lower()] = per.get(m.group(1).lower(), 0) + 1
        return counts
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkout", help="a checkout of SandboxFusion's repository")
    ap.add_argument("--url")
    ap.add_argument("--token")
    ap.add_argument("--json", help="write the counts here")
    ap.add_argument("--only", help="test files to run, comma-separated (test_ruby,test_php)")
    ns = ap.parse_args()
    proc = None
    data_dir = None
    url, token = ns.url, ns.token
    if url is None:
        proc, url, token, data_dir = private_server(data_dir_default())
    try:
        counts = run(ns.checkout, url, token, ns.only.split(",") if ns.only else None)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
        if data_dir:
            shutil.rmtree(data_dir, ignore_errors=True)
    total = {k: sum(c.get(k, 0) for c in counts.values()) for k in ("passed", "failed", "error", "skipped")}
    for name, c in sorted(counts.items()):
        print(f"{name:<24} " + " ".join(f"{k} {v}" for k, v in sorted(c.items())))
    print("total " + " ".join(f"{k} {v}" for k, v in total.items()))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"files": counts, "total": total}, f, indent=1)


if __name__ == "__main__":
    main()
