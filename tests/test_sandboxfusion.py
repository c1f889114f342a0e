"""SandboxFusion's API on dsec's FnCall, against the real platform: the unmodified
``sandbox-fusion`` client, the exact request verl builds, every language, limits,
files, auth and bad input."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import requests
import sandbox_fusion
from sandbox_fusion import RunCodeRequest, RunStatus, SummaryMapping, run_code, run_code_async, summary_run_code_result
from sandbox_fusion import config as sf_config

import dsec
from dsec.faces.sandboxfusion.face import SandboxFusionFace
from tests.conftest import TOKEN, Platform

HELLO = {  # each prints "hello <first line of stdin>"
    "python": 'print("hello", input())',
    "bash": 'read x; echo "hello $x"',
    "c": '#include <stdio.h>\nint main(){char b[64]; scanf("%63s", b); printf("hello %s\\n", b);}',
    "cpp": '#include <iostream>\n#include <string>\nint main(){std::string s; std::cin >> s; '
           'std::cout << "hello " << s << std::endl;}',
    "java": 'import java.util.*;\npublic class Main { public static void main(String[] a) { '
            'System.out.println("hello " + new Scanner(System.in).next()); } }',
    "go": 'package main\nimport "fmt"\nfunc main() { var s string; fmt.Scan(&s); fmt.Println("hello", s) }',
    "nodejs": 'const s = require("fs").readFileSync(0, "utf8").trim(); console.log("hello " + s)',
    "rust": 'use std::io::Read;\nfn main() { let mut s = String::new(); std::io::stdin().read_to_string(&mut s)'
            '.unwrap(); println!("hello {}", s.trim()); }',
}
COMPILED = {"c", "cpp", "java", "go", "rust"}
# allocate (and touch) N MiB; {n} is filled in
ALLOC = {
    "python": "x = bytearray({n} << 20)\nprint(len(x) >> 20)",
    "java": "public class Main {{ public static void main(String[] a) {{ long[][] x = new long[{n}][]; "
            "for (int i = 0; i < {n}; i++) x[i] = new long[1 << 17]; System.out.println(x.length); }} }}",
    "go": 'package main\nimport "fmt"\nfunc main() {{ x := make([]byte, {n}<<20); for i := range x {{ x[i] = 1 }}; '
          'fmt.Println(len(x) >> 20) }}',
    "nodejs": "const a = []; for (let i = 0; i < {n}; i++) a.push(new Array(1 << 17).fill(i)); console.log(a.length)",
    "rust": 'fn main() {{ let v = vec![1u8; {n} << 20]; '
            'println!("{{}}", v.iter().filter(|&&b| b == 1).count() >> 20); }}',
}


def run_url(platform: Platform, token: str = TOKEN) -> str:
    return f"{platform.url}/sandboxfusion/{token}/run_code"


def post(platform: Platform, body: dict[str, Any], token: str = TOKEN, timeout: float = 120) -> httpx.Response:
    return httpx.post(run_url(platform, token), json=body, timeout=timeout)


@pytest.fixture
def sf_endpoint(platform: Platform) -> Iterator[str]:
    """The sandbox-fusion client pointed at dsec the way its docs say: set_sandbox_endpoint."""
    before = sf_config.SANDBOX_ENDPOINT
    endpoint = f"{platform.url}/sandboxfusion/{TOKEN}"
    sandbox_fusion.set_sandbox_endpoint(endpoint)
    yield endpoint
    sandbox_fusion.set_sandbox_endpoint(before)


def test_sandbox_fusion_client_at_its_defaults(sf_endpoint: str) -> None:
    r = run_code(RunCodeRequest(code="import sys; print(sys.stdin.read()[::-1])", language="python", stdin="abc"))
    assert r.status == RunStatus.Success and r.message == "", r
    assert r.run_result is not None and r.run_result.stdout == "cba\n" and r.run_result.return_code == 0
    assert r.compile_result is None and r.executor_pod_name and r.executor_pod_name.startswith("edge0-")
    assert 0 < r.run_result.execution_time < 5
    bad = run_code(RunCodeRequest(code="int main( {", language="cpp"))
    assert bad.status == RunStatus.Failed and bad.run_result is None
    assert summary_run_code_result(bad, SummaryMapping(CompileFailed="CE")) == "CE"
    crash = run_code(RunCodeRequest(code="raise SystemExit(3)", language="python"))
    assert summary_run_code_result(crash, SummaryMapping(RunFailed="RE")) == "RE"


def test_verl_request_exactly_as_verl_builds_it(platform: Platform) -> None:
    """verl's reward_score/sandbox_fusion/utils.py call_sandbox_api: json.dumps'd body
    posted as data to sandbox_fusion_url (the whole run_code URL), stdin None or a string."""
    code = "import sys\nn = sys.stdin.read().split()\nprint(sum(map(int, n)) if n else 'none')"
    for stdin, want in ((None, "none\n"), ("1 2 39", "42\n")):
        payload = json.dumps({"compile_timeout": 10, "run_timeout": 10, "code": code, "stdin": stdin,
                              "memory_limit_MB": 1024, "language": "python", "files": {}, "fetch_files": []})
        resp = requests.post(run_url(platform), headers={"Content-Type": "application/json",
                                                         "Accept": "application/json"},
                             data=payload, timeout=10 + 10 + 10)
        resp.raise_for_status()
        out = resp.json()
        assert out["status"] == "Success" and out["run_result"]["stdout"] == want, out
        assert out["run_result"]["status"] == "Finished" and out["run_result"]["return_code"] == 0
        assert set(out) >= {"status", "message", "compile_result", "run_result", "executor_pod_name", "files"}


@pytest.mark.parametrize("language", list(HELLO))
def test_each_language_hello_with_stdin(platform: Platform, language: str) -> None:
    r = post(platform, {"code": HELLO[language], "language": language, "stdin": "world\n"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["status"] == "Success", out
    assert out["run_result"]["stdout"] == "hello world\n" and out["run_result"]["return_code"] == 0
    if language in COMPILED:
        assert out["compile_result"]["status"] == "Finished" and out["compile_result"]["return_code"] == 0
    else:
        assert out["compile_result"] is None


@pytest.mark.parametrize("language,code,says", [
    ("cpp", "int main() { return undeclared; }", "was not declared"),
    ("java", "public class Main { public static void main(String[] a) { int x = \"s\"; } }", "incompatible types"),
    ("go", "package main\nfunc main() { x := 1 }", "declared but not used"),
    ("rust", "fn main() { let x: u32 = \"s\"; }", "mismatched types"),
])
def test_compile_error_is_failed_with_compile_result(platform: Platform, language: str, code: str, says: str) -> None:
    out = post(platform, {"code": code, "language": language}).json()
    assert out["status"] == "Failed" and out["run_result"] is None, out
    comp = out["compile_result"]
    assert comp["status"] == "Finished" and comp["return_code"] not in (0, None)
    assert says in comp["stderr"] + comp["stdout"], comp


def test_run_timeout_is_wall_clock(platform: Platform) -> None:
    sleep, spin = [post(platform, {"code": code, "language": "python", "run_timeout": 1}).json()
                   for code in ("import time; time.sleep(30)", "while True: pass")]
    for out in (sleep, spin):
        assert out["status"] == "Failed" and out["run_result"]["status"] == "TimeLimitExceeded", out
        assert out["run_result"]["return_code"] is None
        assert 0.9 <= out["run_result"]["execution_time"] < 2.5  # SandboxFusion's limit is wall time, not 2 x + 1
    ok = post(platform, {"code": "import time; time.sleep(0.5); print('done')", "language": "python",
                         "run_timeout": 2}).json()
    assert ok["status"] == "Success" and ok["run_result"]["stdout"] == "done\n"


@pytest.mark.parametrize("language", list(ALLOC))
def test_memory_limit(platform: Platform, language: str) -> None:
    over, under = [post(platform, {"code": ALLOC[language].format(n=n), "language": language,
                                   "memory_limit_MB": 256}).json() for n in (600, 64)]
    assert over["status"] == "Failed", over
    assert over["run_result"]["status"] == "Finished" and over["run_result"]["return_code"] != 0
    assert "out of memory" in over["message"]
    assert under["status"] == "Success" and under["run_result"]["stdout"] == "64\n", under


@pytest.mark.parametrize("language,code", [
    ("python", "print('y' * 9_000_000)"),
    ("c", '#include <stdio.h>\nint main(){for (long i = 0; i < 3000000; i++) puts("yyyy");}'),
])
def test_output_past_the_limit_is_cut_and_failed(platform: Platform, language: str, code: str) -> None:
    out = post(platform, {"code": code, "language": language}).json()
    assert out["status"] == "Failed" and "output past 8 MiB" in out["message"], out["message"]
    assert len(out["run_result"]["stdout"]) == 8 << 20 and out["run_result"]["return_code"] != 0


def test_files_in_and_fetch_files_out(platform: Platform) -> None:
    blob = bytes(range(256)) * 3
    code = ("import hashlib, os\n"
            "data = open('in/blob.bin', 'rb').read()\n"
            "open('out.bin', 'wb').write(data[::-1])\n"
            "os.makedirs('res', exist_ok=True)\n"
            "open('res/sum.txt', 'w').write(hashlib.sha256(data).hexdigest())\n"
            "print(open('note.txt').read(), os.path.exists('skipped'))")
    out = post(platform, {"code": code, "language": "python",
                          "files": {"in/blob.bin": base64.b64encode(blob).decode(),
                                    "note.txt": base64.b64encode(b"hi").decode(), "skipped": None},
                          "fetch_files": ["out.bin", "res/sum.txt", "missing.txt"]}).json()
    assert out["status"] == "Success" and out["run_result"]["stdout"] == "hi False\n", out
    assert set(out["files"]) == {"out.bin", "res/sum.txt"}  # a missing file is left out, as SandboxFusion does
    assert base64.b64decode(out["files"]["out.bin"]) == blob[::-1]
    assert base64.b64decode(out["files"]["res/sum.txt"]).decode() == hashlib.sha256(blob).hexdigest()
    # a compiled language's files sit next to its source too
    java = ("import java.nio.file.*;\npublic class Main { public static void main(String[] a) throws Exception { "
            "Files.writeString(Path.of(\"o.txt\"), Files.readString(Path.of(\"i.txt\")).toUpperCase()); } }")
    j = post(platform, {"code": java, "language": "java", "files": {"i.txt": base64.b64encode(b"abc").decode()},
                        "fetch_files": ["o.txt"]}).json()
    assert j["status"] == "Success" and base64.b64decode(j["files"]["o.txt"]) == b"ABC", j


def test_a_symlink_out_of_the_scratch_dir_is_not_fetched(platform: Platform) -> None:
    out = post(platform, {"code": "import os; os.symlink('/opt/dsec-fncall/worker.py', 'w.py')",
                          "language": "python", "fetch_files": ["w.py"]}).json()
    assert out["status"] == "Success" and out["files"] == {}, out


def test_unsupported_language_is_400_listing_the_supported(platform: Platform) -> None:
    r = post(platform, {"code": "DISPLAY 'HI'.", "language": "cobol"})
    assert r.status_code == 400
    body = r.json()
    assert body["field"] == "language" and body["status"] == "SandboxError"
    for name in ("python", "cpp", "java", "go", "nodejs", "rust", "bash", "ruby", "php", "D_ut", "jest"):
        assert name in body["message"]
    julia = post(platform, {"code": "println(1)", "language": "julia"})  # SandboxFusion's, not servable here
    assert julia.status_code == 501 and julia.json()["field"] == "language" and "Debian" in julia.json()["message"]


@pytest.mark.parametrize("body,field", [
    ({"language": "python"}, "code"),
    ({"code": "print(1)"}, "language"),
    ({"code": "print(1)", "language": "python", "run_timeout": "soon"}, "run_timeout"),
    ({"code": "print(1)", "language": "python", "run_timeout": 600}, "run_timeout"),
    ({"code": "print(1)", "language": "python", "compile_timeout": -1}, "compile_timeout"),
    ({"code": "print(1)", "language": "python", "memory_limit_MB": 4}, "memory_limit_MB"),
    ({"code": "print(1)", "language": "python", "files": {"/etc/passwd": "eA=="}}, "files"),
    ({"code": "print(1)", "language": "python", "files": {"a.txt": "not base64!"}}, "files"),
    ({"code": "print(1)", "language": "python", "fetch_files": ["../../x"]}, "fetch_files"),
])
def test_bad_field_is_400_naming_it(platform: Platform, body: dict[str, Any], field: str) -> None:
    r = post(platform, body)
    assert r.status_code == 400, r.text
    assert r.json()["field"] == field and r.json()["message"].startswith(field), r.text


def test_body_that_is_not_json_is_400(platform: Platform) -> None:
    r = httpx.post(run_url(platform), content=b"print(1)", timeout=30)
    assert r.status_code == 400 and r.json()["field"] == "body"


async def test_auth_token_in_url_or_header(platform: Platform, client: dsec.AsyncClient) -> None:
    body = {"code": "print(7)", "language": "python"}
    async with httpx.AsyncClient(timeout=60) as h:
        wrong = await h.post(f"{platform.url}/sandboxfusion/dsec_not-a-token/run_code", json=body)
        assert wrong.status_code == 401 and wrong.json()["field"] == "token" and "invalid" in wrong.json()["message"]
        bare = await h.post(f"{platform.url}/sandboxfusion/run_code", json=body)
        assert bare.status_code == 401 and bare.json()["field"] == "authorization"
        header = await h.post(f"{platform.url}/sandboxfusion/run_code", json=body,
                              headers={"Authorization": f"Bearer {TOKEN}"})
        assert header.status_code == 200 and header.json()["run_result"]["stdout"] == "7\n"
        runner = await client.create_token("sf-test", "runner")  # a token that may use sandboxes is enough
        assert runner.token
        ok = await h.post(f"{platform.url}/sandboxfusion/{runner.token}/run_code", json=body)
        assert ok.status_code == 200 and ok.json()["status"] == "Success", ok.text
        await client.revoke_token(runner.id)
        revoked = await h.post(f"{platform.url}/sandboxfusion/{runner.token}/run_code", json=body)
        assert revoked.status_code == 401
        assert (await h.get(f"{platform.url}/sandboxfusion/v1/ping")).json() == "pong"
        assert (await h.get(f"{platform.url}/sandboxfusion/{TOKEN}/v1/ping")).json() == "pong"
        assert (await h.get(f"{platform.url}/sandboxfusion/nope/v1/ping")).status_code == 401
        jupyter = await h.post(f"{platform.url}/sandboxfusion/{TOKEN}/run_jupyter", json={"cells": ["1"]})
        assert jupyter.status_code == 501 and "run_code" in jupyter.json()["message"]


async def test_token_is_cut_from_the_path_before_logging() -> None:
    """The server's access log prints the request scope's path: the face rewrites it in
    place before answering, a refused token included."""
    class Tokens:
        async def verify(self, secret: bytes) -> None:
            return None

    class Api:
        tokens = Tokens()

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("the face serves its own prefix")

    face = SandboxFusionFace(inner, Api())  # type: ignore[arg-type]
    scope = {"type": "http", "method": "POST", "path": "/sandboxfusion/dsec_secret123/run_code",
             "raw_path": b"/sandboxfusion/dsec_secret123/run_code", "query_string": b"", "headers": []}
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    await face(scope, receive, send)
    assert sent[0]["status"] == 401
    assert b"secret123" not in scope["raw_path"] and "secret123" not in scope["path"]
    assert scope["raw_path"] == b"/sandboxfusion/***/run_code"


async def test_sixteen_at_once_with_the_async_client(platform: Platform) -> None:
    endpoint = f"{platform.url}/sandboxfusion/{TOKEN}"
    reqs = [RunCodeRequest(code="import sys; print(int(sys.stdin.read()) ** 2)", language="python", stdin=str(i))
            for i in range(16)]
    results = await asyncio.gather(*[run_code_async(r, endpoint=endpoint, max_attempts=1) for r in reqs])
    assert [r.status for r in results] == [RunStatus.Success] * 16
    assert [r.run_result.stdout for r in results if r.run_result] == [f"{i * i}\n" for i in range(16)]
