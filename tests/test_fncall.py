"""FnCall against the real platform: pooled crun containers on the default FnCall image with warm
worker processes, real compilers, real limits."""

from __future__ import annotations

import hashlib
import os

import httpx
import pytest

import dsec
from dsec.node.backends.fncall.pool import WORKER_PATH
from dsec.shared.wire.models import FnCallArgs, TestCase
from tests.conftest import TOKEN, Platform

CPP_SUM = """
#include <iostream>
int main() { long a, b; std::cin >> a >> b; std::cout << a + b << "\\n"; }
"""


async def test_python_hello_and_stdin(client: dsec.AsyncClient) -> None:
    r = await client.fncall(FnCallArgs(language="python", code="print(sum(map(int, input().split())))",
                                       stdin="1 2\n", time_limit_s=2, memory_limit_mb=256))
    assert r.status == "ok" and r.stdout == "3\n" and r.exit_code == 0, r
    assert r.memory_kb > 0 and r.wall_ms > 0
    assert r.container.rsplit("-", 1)[0] in {n.edge for n in await client.nodes()}  # a pooled container of an edge
    again = await client.fncall(FnCallArgs(language="python", code="import sys; print('x', file=sys.stderr); exit(3)"))
    assert again.status == "runtime_error" and again.exit_code == 3 and again.stderr == "x\n"


async def test_cpp_compile_once_run_many_with_verdicts(client: dsec.AsyncClient) -> None:
    r = await client.fncall(FnCallArgs(language="cpp", code=CPP_SUM, tests=[
        TestCase(stdin="1 2", expected_stdout="3"),
        TestCase(stdin="40 2", expected_stdout="42\n"),
        TestCase(stdin="1 1", expected_stdout="3"),
    ]))
    assert r.compile is not None and r.compile.status == "ok"
    assert [t.verdict for t in r.tests] == ["accepted", "accepted", "wrong_answer"]
    assert r.status == "ok" and r.stdout == "2\n"  # the first failing test is the one shown
    bad = await client.fncall(FnCallArgs(language="c", code="int main() { return x; }"))
    assert bad.status == "compile_error" and "x" in bad.stderr and "error" in bad.stderr


async def test_compiled_artifact_reused_and_modules_prewarmed(client: dsec.AsyncClient) -> None:
    code = '#include <stdio.h>\nint main(){int n; scanf("%d", &n); printf("%d\\n", n * 2);}\n'
    first = await client.fncall(FnCallArgs(language="c", code=code, stdin="21"))
    second = await client.fncall(FnCallArgs(language="c", code=code, stdin="50"))
    assert first.compile is not None and not first.compile.cached and first.stdout == "42\n"
    assert second.compile is not None and second.compile.cached and second.stdout == "100\n"
    warm = await client.fncall(FnCallArgs(language="python", code="import sys; print('statistics' in sys.modules)",
                                          preimport=["statistics"]))
    cold = await client.fncall(FnCallArgs(language="python", code="import sys; print('statistics' in sys.modules)"))
    assert (warm.stdout, cold.stdout) == ("True\n", "False\n")
    assert warm.container != cold.container  # a pool of its own for that worker configuration


async def test_limits_and_runtime_errors(client: dsec.AsyncClient) -> None:
    tle, mle, seg, ole, bash = [await client.fncall(a) for a in (
        FnCallArgs(language="python", code="while True: pass", time_limit_s=1),
        FnCallArgs(language="python", code="x = bytearray(400 << 20)", memory_limit_mb=128),
        FnCallArgs(language="c", code="int main() { volatile int *p = 0; return *p; }"),
        FnCallArgs(language="python", code="print('y' * 10_000_000)", output_limit_kb=64),
        FnCallArgs(language="bash", code="echo $((6*7)); ls /", time_limit_s=2),
    )]
    assert tle.status == "time_limit" and 900 <= tle.time_ms < 4000, tle
    assert mle.status == "memory_limit", mle
    assert seg.status == "runtime_error" and seg.signal == 11, seg
    assert ole.status == "output_limit" and len(ole.stdout) == 64 * 1024
    assert bash.status == "ok" and bash.stdout.startswith("42\n")


async def test_comparators(client: dsec.AsyncClient) -> None:
    code = "print('1.0000001  2')"
    verdicts = []
    for cmp in ("exact", "whitespace", "float"):
        r = await client.fncall(FnCallArgs(language="python", code=code, comparator=cmp,
                                           tests=[TestCase(expected_stdout="1.0 2\n")]))
        verdicts.append(r.tests[0].verdict)
    assert verdicts == ["wrong_answer", "wrong_answer", "accepted"]


HOSTILE = r"""
WORKER = 'WORKER_PATH'

import os, subprocess, time
open('/tmp/planted', 'w').write('secret')
open('/var/tmp/planted', 'w').write('secret')
try:
    open(WORKER, 'a').write('# pwned')
    print('WROTE WORKER')
except OSError as e:
    print('worker protected', e.errno)
subprocess.Popen(['sleep', '1000'], start_new_session=True)
n = 0
try:
    while True:  # a fork bomb, stopped by the pids limit
        if os.fork() == 0:
            time.sleep(30); os._exit(0)
        n += 1
except OSError:
    print('forks stopped at', n)
with open('fill', 'wb') as f:  # fill the disk, stopped by the file size limit
    try:
        while True: f.write(b'x' * (1 << 20))
    except OSError:
        print('fill stopped')
""".replace("WORKER_PATH", WORKER_PATH)

BENIGN = r"""
import os, subprocess
print(os.path.exists('/tmp/planted'), os.path.exists('/var/tmp/planted'), sorted(os.listdir('.')))
print(subprocess.run(['ps', '-eo', 'user,comm'], capture_output=True, text=True).stdout.count('sleep'))
print(__import__('hashlib').sha256(open('WORKER_PATH', 'rb').read()).hexdigest())
""".replace("WORKER_PATH", WORKER_PATH)


async def test_hostile_call_then_benign_sees_nothing(client: dsec.AsyncClient) -> None:
    bad = await client.fncall(FnCallArgs(language="python", code=HOSTILE, time_limit_s=3, pids_limit=16,
                                         output_limit_kb=256))
    assert "worker protected 13" in bad.stdout and "WROTE WORKER" not in bad.stdout, bad
    assert "forks stopped at" in bad.stdout and "fill stopped" in bad.stdout, bad
    with open(os.path.join(os.path.dirname(dsec.__file__), "node", "backends", "fncall", "worker.py"), "rb") as f:
        worker_sum = hashlib.sha256(f.read()).hexdigest()
    for _ in range(4):  # whichever container and worker it lands on
        ok = await client.fncall(FnCallArgs(language="python", code=BENIGN))
        assert ok.status == "ok", ok
        lines = ok.stdout.splitlines()
        assert lines[0] == "False False ['main.py']" and lines[1] == "0" and lines[2] == worker_sum, ok.stdout
        assert ok.container != bad.container  # the hostile call's container was retired


SNOOP = r"""
import gc
needle = 'SEC' + 'RET-'
hits = 0
for o in gc.get_objects():
    if o is globals():
        continue
    vals = list(o.values()) if isinstance(o, dict) else o if isinstance(o, list) else []
    hits += sum(1 for v in vals if isinstance(v, str) and needle in v and v != needle)
print(hits)
"""


async def test_a_call_process_holds_no_other_input(client: dsec.AsyncClient) -> None:
    """Call processes are forked from a zygote that never saw a request: the other test
    cases' inputs (or an earlier call's) are not in a call's memory."""
    await client.fncall(FnCallArgs(language="python", code="print(1)", stdin="SECRET-earlier-call"))
    r = await client.fncall(FnCallArgs(language="python", code=SNOOP, tests=[
        TestCase(stdin="SECRET-first-test"), TestCase(stdin="SECRET-second-test")]))
    assert [t.stdout for t in r.tests] == ["0\n", "0\n"], r


async def test_calls_do_not_see_each_other(client: dsec.AsyncClient) -> None:
    await client.fncall(FnCallArgs(language="python", code="open('left.txt', 'w').write('x')",
                                   files={"data/in.txt": "hello"}))
    r = await client.fncall(FnCallArgs(language="python", code="import os; print(sorted(os.listdir('.')))"))
    assert r.stdout == "['main.py']\n"
    f = await client.fncall(FnCallArgs(language="bash", code="cat data/in.txt", files={"data/in.txt": "hello"}))
    assert f.stdout == "hello"


async def test_fncall_many_keeps_order(client: dsec.AsyncClient) -> None:
    calls = [FnCallArgs(language="python", code=f"print({i} * {i})") for i in range(12)]
    results = await client.fncall_many(calls, concurrency=4)
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(12)]


def _post(platform: Platform, body: object) -> httpx.Response:
    return httpx.post(f"{platform.url}/v1/fncall", json=body, headers={"Authorization": f"Bearer {TOKEN}"},
                      timeout=60)


@pytest.mark.parametrize(("body", "field"), [
    ({"language": "cobol", "code": "x"}, "language"),
    ({"language": "python", "code": ""}, "code"),
    ({"language": "python", "code": "x", "stdin": "x" * (17 << 20)}, "stdin"),
    ({"language": "python", "code": "x", "tests": [{"stdin": 5}]}, "tests"),
    ({"language": "python", "code": "x", "files": {"../escape": "x"}}, "files"),
    ({"language": "python", "code": "x", "time_limit_s": 0}, "time_limit_s"),
    ({"language": "python", "code": "x", "memory_limit_mb": 4096}, "memory_limit_mb"),
    ({"language": "python", "code": "x", "image": "base/nope:1"}, "image"),
])
def test_bad_fncall_requests(platform: Platform, body: object, field: str) -> None:
    r = _post(platform, body)
    assert 400 <= r.status_code < 500 and r.json().get("field", "").startswith(field), r.text


def test_languages_cli(platform: Platform) -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "dsec.client.cli.main", "fncall", "languages", "--url", platform.url,
                          "--token", TOKEN], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert {"python", "bash", "c", "cpp"} <= set(out.stdout.split())
