"""The cluster's daemon ownership (dsec.control.cluster.daemon): a daemon whose start fails is
started again by its owner with backoff, each failure reported (what `dsec cluster status`
shows), the report cleared once it serves. A real process: it fails its first two starts
and then serves HTTP."""

from __future__ import annotations

import sys
from pathlib import Path

from dsec.control.cluster.daemon import START_BACKOFF_S, Daemon, http_ok, start_retrying
from tests.conftest import _free_port

FLAKY = """
import http.server, os, sys
p = {counter!r}
n = int(open(p).read()) if os.path.exists(p) else 0
open(p, 'w').write(str(n + 1))
if n < 2:
    print('layer base/busybox:latest is already published with another content (start', n + 1, ')', flush=True)
    sys.exit(3)
http.server.HTTPServer(('127.0.0.1', {port}), http.server.SimpleHTTPRequestHandler).serve_forever()
"""


def test_a_failed_start_is_tried_again_and_said_until_it_serves(tmp_path: Path) -> None:
    port = _free_port()
    script = FLAKY.format(counter=str(tmp_path / "starts"), port=port)
    healthy = http_ok(f"http://127.0.0.1:{port}/", {})
    reports: list[tuple[str | None, int]] = []
    d = start_retrying(lambda: Daemon([sys.executable, "-c", script], str(tmp_path / "daemon.log"), healthy),
                       lambda error, tries: reports.append((error, tries)))
    try:
        assert [t for _, t in reports] == [1, 2, 3]
        assert all(e is not None and "already published with another content" in e for e, _ in reports[:2]), reports
        assert reports[2][0] is None  # serving: the failure is no longer reported
        assert healthy() and (tmp_path / "starts").read_text() == "3"
    finally:
        d.stop()
    assert START_BACKOFF_S[0] >= 1 and START_BACKOFF_S[-1] <= 30  # backs off, and keeps trying every 30 s at most
