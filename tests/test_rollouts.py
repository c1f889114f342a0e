"""The rollout service end to end (docs/rl.md, "Rollouts that outlive the trainer"): real
``dsec rollout-worker`` processes run agent loops (tests/rollout_agents.py) on a real
platform; trainers are processes killed with SIGKILL; workers are killed mid-rollout.
The inference endpoint is a small OpenAI-compatible server in this process standing in
for a model server (outside the machine in real use): it counts the calls it answers."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator

import httpx
import pytest
from aiohttp import web

import dsec
from tests.conftest import TOKEN, Platform, _free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUSYBOX = dsec.ContainerArgs(image="base/busybox:latest")


class FakeLLM:
    """OpenAI-compatible chat completions: the reply names the call's number for its rollout."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.loop = asyncio.new_event_loop()
        self.down = False
        self.refuse = False
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result()

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def _chat(self, req: web.Request) -> web.Response:
        if self.down:
            return web.json_response({"error": "restarting"}, status=503)
        if self.refuse:
            return web.json_response({"error": {"message": "prompt too long"}}, status=400)
        body = await req.json()
        rollout = body["messages"][-1]["content"].split()[0]
        self.calls[rollout] += 1
        n = self.calls[rollout]
        return web.json_response({"id": f"c{n}", "object": "chat.completion", "model": body.get("model", ""),
                                  "choices": [{"index": 0, "finish_reason": "stop",
                                               "message": {"role": "assistant", "content": f"reply{n}"}}]})

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def llm() -> Iterator[FakeLLM]:
    s = FakeLLM()
    yield s
    s.close()


class Workers:
    """``dsec rollout-worker`` processes, stopped at the end of the test."""

    def __init__(self, platform: Platform, log_dir: str) -> None:
        self.platform, self.log_dir = platform, log_dir
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, lease_s: float = 30.0, concurrency: int = 16) -> subprocess.Popen[bytes]:
        log = open(os.path.join(self.log_dir, f"worker-{len(self.procs)}.log"), "ab")  # noqa: SIM115
        p = subprocess.Popen([sys.executable, "-m", "dsec.client.cli.main", "rollout-worker", "--url",
                              self.platform.url,
                              "--token", TOKEN, "--path", REPO, "--lease-s", str(lease_s), "--concurrency",
                              str(concurrency)], stdout=log, stderr=log, cwd=REPO, start_new_session=True)
        self.procs.append(p)
        return p

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture
def workers(platform: Platform, tmp_path: os.PathLike[str]) -> Iterator[Workers]:
    w = Workers(platform, str(tmp_path))
    yield w
    w.stop_all()


@pytest.fixture
def client(platform: Platform) -> Iterator[dsec.Client]:
    with dsec.Client(url=platform.url, token=TOKEN) as c:
        yield c


def _wait(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _key() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


def _finished(c: dsec.Client, ids: list[str], timeout: float = 120) -> list[dsec.RolloutInfo]:
    out: dict[str, dsec.RolloutInfo] = {}

    def done() -> bool:
        for i in ids:
            if i not in out:
                r = c.rollouts.get(i)
                if r.state in ("done", "failed", "cancelled"):
                    out[i] = r
        return len(out) == len(ids)
    _wait(done, timeout, f"rollouts {ids}")
    return [out[i] for i in ids]


def test_rollouts_run_on_workers_and_trainer_consumes(client: dsec.Client, workers: Workers, llm: FakeLLM) -> None:
    workers.start()
    specs = [dsec.RolloutSpec(agent="tests.rollout_agents:turns", key=_key(), task={"turns": 3, "reward": i / 4},
                              args=BUSYBOX, inference=dsec.Inference(base_url=llm.url, model="m"))
             for i in range(4)]
    made = client.rollouts.submit(specs)
    assert [r.state for r in made] == ["queued"] * 4
    again = client.rollouts.submit(specs)  # the same keys: the same rollouts, none new
    assert [r.id for r in again] == [r.id for r in made]
    got = {}
    for r in client.rollouts.finished(timeout=120):
        got[r.id] = r
        if len(got) == 4:
            break
    assert set(got) == {r.id for r in made}
    for i, m in enumerate(made):
        r = got[m.id]
        assert r.state == "done" and r.failure is None, r.error
        assert r.reward == i / 4
        assert r.result == {"reward": i / 4, "lines": 3, "attempt": 1}
        full = client.rollouts.get(r.id, steps=True)
        assert [s.kind for s in full.steps or []] == ["llm", "shell"] * 3 + ["exec"]
        assert full.steps is not None and full.steps[1].response["exit_code"] == 0
        assert llm.calls[r.id] == 3
        # its sandbox was stopped when it ended
        assert not [s for s in client.list(labels={"dsec.rollout": r.id}) if s.state == "running"]
    assert client.rollouts.ack([m.id for m in made]) == 4
    assert not {x.id for x in client.rollouts.wait(timeout=0, limit=10_000)} & set(got)


def test_trainer_sigkill_loses_no_rollout(client: dsec.Client, workers: Workers, platform: Platform,
                                          tmp_path: os.PathLike[str]) -> None:
    """A trainer process submits 6 rollouts by key and is SIGKILLed after taking 2; a new one
    resubmits the same keys (no new rollout), and takes the other 4: each exactly once."""
    workers.start()
    keys = [_key() for _ in range(6)]
    out = os.path.join(str(tmp_path), "taken.jsonl")
    cmd = [sys.executable, "-m", "tests.rollout_agents", platform.url, TOKEN, ",".join(keys)]
    first = subprocess.Popen([*cmd, "2", out, "hang"], cwd=REPO)
    try:
        _wait(lambda: os.path.exists(out) and len(open(out).read().splitlines()) >= 2, 120, "2 rollouts taken")
    finally:
        first.kill()  # SIGKILL: no cleanup of any kind
        first.wait()
    taken = [json.loads(x) for x in open(out).read().splitlines()]
    assert len(taken) == 2
    subprocess.run([*cmd, "4", out, "exit"], cwd=REPO, check=True, timeout=180)
    taken = [json.loads(x) for x in open(out).read().splitlines()]
    assert sorted(t["key"] for t in taken) == sorted(keys)  # each key once: none lost, none taken twice
    assert len({t["pid"] for t in taken}) == 2
    rs = client.rollouts.list(state=["done"])
    mine = [r for r in rs if r.key in keys]
    assert len(mine) == 6 and all(r.consumed for r in mine)
    assert all(r.result["lines"] == 2 and r.attempts == 1 for r in mine)  # type: ignore[index]


def test_worker_sigkill_runs_no_turn_twice(client: dsec.Client, workers: Workers, llm: FakeLLM) -> None:
    """The worker is SIGKILLed mid-rollout; another takes the rollout over when its lease runs
    out and replays the journal: every inference call and every command happened once."""
    first = workers.start(lease_s=3)
    spec = dsec.RolloutSpec(agent="tests.rollout_agents:turns", key=_key(), task={"turns": 5, "sleep": 1},
                            args=BUSYBOX, inference=dsec.Inference(base_url=llm.url))
    rid = client.rollouts.submit([spec])[0].id
    _wait(lambda: client.rollouts.get(rid).n_steps >= 5, 60, "a few steps")
    first.kill()
    first.wait()
    before = client.rollouts.get(rid)
    assert before.state == "running" and before.attempts == 1
    workers.start(lease_s=3)
    (r,) = _finished(client, [rid])
    assert r.state == "done", r.error
    assert r.attempts == 2
    assert r.result == {"reward": 1.0, "lines": 5, "attempt": 2}  # 5 commands ran, once each
    assert llm.calls[rid] == 5  # 5 completions, once each
    steps = client.rollouts.get(rid, steps=True).steps or []
    assert [s.seq for s in steps] == list(range(11))
    assert {s.attempt for s in steps} == {1, 2}
    sb_log = [s.response for s in steps if s.kind == "llm"]
    assert [m["choices"][0]["message"]["content"] for m in sb_log] == [f"reply{n}" for n in range(1, 6)]


def test_inference_endpoint_restarting_is_waited_for(client: dsec.Client, workers: Workers, llm: FakeLLM) -> None:
    """An endpoint answering 503 (a trainer's server restarting with it) is retried, not failed."""
    workers.start()
    llm.down = True
    try:
        rid = client.rollouts.submit([dsec.RolloutSpec(agent="tests.rollout_agents:turns", task={"turns": 1},
                                                       args=BUSYBOX, inference=dsec.Inference(base_url=llm.url))])[0].id
        _wait(lambda: client.rollouts.get(rid).sandbox_id is not None, 60, "the rollout to start")
        time.sleep(2)
        assert client.rollouts.get(rid).state == "running"
    finally:
        llm.down = False
    (r,) = _finished(client, [rid])
    assert r.state == "done" and llm.calls[rid] == 1


def test_inference_refusal_is_the_workloads(client: dsec.Client, workers: Workers, llm: FakeLLM) -> None:
    """A request the endpoint refuses (a 400: a prompt past the context) fails the rollout as the
    workload's at once, not retried as the platform's."""
    workers.start()
    llm.refuse = True
    try:
        rid = client.rollouts.submit([dsec.RolloutSpec(agent="tests.rollout_agents:turns", task={"turns": 1},
                                                       args=BUSYBOX, inference=dsec.Inference(base_url=llm.url))])[0].id
        (r,) = _finished(client, [rid])
    finally:
        llm.refuse = False
    assert r.state == "failed" and r.failure == "workload" and r.attempts == 1
    assert "HTTP 400" in (r.error or "") and "InferenceRefused" in (r.error or "")


def test_a_lost_lease_fences_the_old_worker(client: dsec.Client, platform: Platform) -> None:
    """The worker protocol over HTTP: once a lease ran out and another worker claimed the
    rollout, the first one's journal writes and outcome are refused (409 rollout_lost), and
    only the holder's count."""
    token = client.create_token(f"ro-cas-{uuid.uuid4().hex[:6]}", "runner").token
    h = {"Authorization": f"Bearer {token}"}
    url = f"{platform.url}/v1/rollouts"
    with dsec.Client(url=platform.url, token=token) as c:
        rid = c.rollouts.submit([dsec.RolloutSpec(agent="m:f")])[0].id
    (got,) = httpx.post(f"{url}/claim", headers=h, json={"worker": "wa", "n": 10, "lease_s": 2}).json()
    assert got["rollout"]["id"] == rid and got["attempt"] == 1
    step = {"seq": 0, "kind": "note", "request": {"name": "x"}, "response": 1, "digest": "d"}
    r = httpx.post(f"{url}/{rid}/steps", headers=h, json={"worker": "wb", "attempt": 1, "step": step})
    assert r.status_code == 409 and r.json()["error"] == "rollout_lost"  # not its rollout
    assert httpx.post(f"{url}/{rid}/steps", headers=h,
                      json={"worker": "wa", "attempt": 1, "step": step}).json()["response"] == 1
    time.sleep(2.5)  # wa's lease runs out without a heartbeat
    (again,) = httpx.post(f"{url}/claim", headers=h, json={"worker": "wb", "n": 10, "lease_s": 30}).json()
    assert again["attempt"] == 2 and [s["response"] for s in again["steps"]] == [1]  # the journal carried over
    late = {"worker": "wa", "attempt": 1, "state": "done", "reward": 1.0}
    r = httpx.post(f"{url}/{rid}/finish", headers=h, json=late)
    assert r.status_code == 409 and r.json()["error"] == "rollout_lost"
    step2 = {**step, "seq": 1}
    r = httpx.post(f"{url}/{rid}/steps", headers=h, json={"worker": "wa", "attempt": 1, "step": step2})
    assert r.status_code == 409
    beat = httpx.post(f"{url}/heartbeat", headers=h, json={"worker": "wa", "ids": [rid]}).json()
    assert beat["rollouts"] == [{"id": rid, "owned": False, "state": "running", "hold": False}]
    done = httpx.post(f"{url}/{rid}/finish", headers=h, json={**late, "worker": "wb", "attempt": 2, "reward": 0.5})
    assert done.status_code == 200 and done.json()["reward"] == 0.5 and done.json()["n_steps"] == 1


def test_a_journaled_command_is_one_call(client: dsec.Client, platform: Platform) -> None:
    """POST /v1/rollouts/{id}/exec (what the worker sends for each command): the command runs
    keyed in the sandbox and its result is the journal's step, in one call; the same seq
    again answers the first write and runs nothing; a call without a key, from a worker that
    does not hold the rollout, or naming another project's sandbox runs nothing."""
    token = client.create_token(f"ro-jx-{uuid.uuid4().hex[:6]}", "runner").token
    h = {"Authorization": f"Bearer {token}"}
    url = f"{platform.url}/v1/rollouts"
    c = dsec.Client(url=platform.url, token=token)
    rid = c.rollouts.submit([dsec.RolloutSpec(agent="m:f")])[0].id
    sb = c.run_container(BUSYBOX)
    theirs = client.run_container(BUSYBOX)  # the admin's default project: not the runner's
    try:
        (got,) = httpx.post(f"{url}/claim", headers=h, json={"worker": "wa", "n": 10, "lease_s": 60}).json()
        assert got["rollout"]["id"] == rid
        cmd = "echo x >> /tmp/runs; wc -l < /tmp/runs"
        step = {"seq": 0, "kind": "shell", "request": {"cmd": cmd}, "digest": "d0"}
        ex = {"cmd": cmd, "session": "default", "key": f"dsec.rollout/{rid}/0"}
        body = {"worker": "wa", "attempt": 1, "sandbox_id": sb.sandbox_id, "step": step, "exec": ex}
        first = httpx.post(f"{url}/{rid}/exec", headers=h, json=body)
        assert first.status_code == 200, first.text
        assert first.json()["seq"] == 0 and first.json()["response"]["stdout"].strip() == "1"
        again = httpx.post(f"{url}/{rid}/exec", headers=h, json=body)  # a retry after a lost answer
        assert again.json() == first.json()
        assert sb.exec("wc -l < /tmp/runs").stdout.strip() == "1"  # it ran once
        assert [s.response["stdout"].strip() for s in client.rollouts.get(rid, steps=True).steps or []] == ["1"]
        assert [r.key for r in sb.command_log()] == [f"dsec.rollout/{rid}/0"]

        def refused(change: dict[str, object]) -> httpx.Response:
            return httpx.post(f"{url}/{rid}/exec", headers=h, json={**body, "step": {**step, "seq": 1},
                                                                        "exec": {**ex, "key": "k1"}, **change})
        r = refused({"exec": {"cmd": "touch /tmp/nokey", "session": "default"}})
        assert r.status_code == 400 and r.json()["field"] == "exec.key"
        r = refused({"worker": "wb"})
        assert r.status_code == 409 and r.json()["error"] == "rollout_lost"
        r = refused({"sandbox_id": theirs.sandbox_id, "exec": {"cmd": "touch /tmp/pwned", "key": "k2"}})
        assert r.status_code == 404 and r.json()["field"] == "sandbox_id"
        assert theirs.exec("ls /tmp/pwned").exit_code != 0
        assert sb.exec("ls /tmp/nokey").exit_code != 0
        r = refused({"exec": {**ex, "key": "k3", "max_output_bytes": 1 << 20}})  # could not fit its step
        assert r.status_code == 400 and r.json()["field"] == "exec.max_output_bytes"
        # another project's token, naming this rollout's worker and attempt (both guessable),
        # sees no such rollout anywhere on the worker's side, and changes nothing
        other = {"Authorization": f"Bearer {client.create_token(f'ro-jx-b-{uuid.uuid4().hex[:6]}', 'runner').token}"}
        for path, payload in (
                ("exec", {**body, "step": {**step, "seq": 1}, "exec": {**ex, "cmd": "touch /tmp/b", "key": "kb"}}),
                ("steps", {"worker": "wa", "attempt": 1, "step": {**step, "seq": 1, "response": "forged"}}),
                ("sandbox", {"worker": "wa", "attempt": 1, "sandbox_id": sb.sandbox_id}),
                ("finish", {"worker": "wa", "attempt": 1, "state": "done", "reward": 99.0})):
            r = httpx.post(f"{url}/{rid}/{path}", headers=other, json=payload)
            assert r.status_code == 404 and r.json()["field"] in ("rollout_id", "sandbox_id"), (path, r.text)
        assert sb.exec("ls /tmp/b").exit_code != 0
        after = client.rollouts.get(rid, steps=True)
        assert after.n_steps == 1 and after.state == "running" and after.reward is None
        assert [s.response["stdout"].strip() for s in after.steps or []] == ["1"]
    finally:
        sb.stop()
        theirs.stop()
        client.rollouts.cancel(rid)
        c.close()


def test_paused_job_holds_its_rollouts(client: dsec.Client, workers: Workers) -> None:
    """Pausing the job pauses its sandboxes and the workers take no new step of its rollouts
    (nothing resumes the sandboxes behind the pause); resuming lets them finish."""
    workers.start()
    job = client.create_job(f"ro-{uuid.uuid4().hex[:8]}")
    rid = client.rollouts.submit([dsec.RolloutSpec(agent="tests.rollout_agents:turns", job=job.name,
                                                   task={"turns": 8, "sleep": 1}, args=BUSYBOX)])[0].id
    _wait(lambda: client.rollouts.get(rid).n_steps >= 2, 60, "two steps")
    job.pause()
    time.sleep(3)  # a step under way when the job paused may still finish
    held = client.rollouts.get(rid).n_steps
    time.sleep(4)
    r = client.rollouts.get(rid)
    assert r.state == "running" and r.n_steps == held < 8
    assert [s.state for s in job.sandboxes()] == [dsec.SandboxState.paused]
    job.resume()
    (r,) = _finished(client, [rid])
    assert r.state == "done" and r.result["lines"] == 8  # type: ignore[index]
    job.stop()


def test_lost_sandbox_starts_the_rollout_over(client: dsec.Client, workers: Workers) -> None:
    workers.start()
    rid = client.rollouts.submit([dsec.RolloutSpec(agent="tests.rollout_agents:loses_sandbox", args=BUSYBOX)])[0].id
    (r,) = _finished(client, [rid])
    assert r.state == "done", r.error
    assert r.result == {"reward": 1.0, "log": ["one", "two"], "attempt": 2}
    steps = client.rollouts.get(rid, steps=True).steps or []
    assert {s.attempt for s in steps} == {2}  # the first attempt's journal described a sandbox that is gone


def test_a_flood_of_output_is_cut_not_fatal(client: dsec.Client, workers: Workers) -> None:
    """3 MB of control characters from a command (each escaped to six bytes in JSON) at the
    default settings: the step is journaled with its output cut, the rollout is done."""
    workers.start()
    rid = client.rollouts.submit([dsec.RolloutSpec(agent="tests.rollout_agents:noisy", args=BUSYBOX)])[0].id
    (r,) = _finished(client, [rid])
    assert r.state == "done", r.error
    assert r.result == {"reward": 1.0, "len": 64 * 1024, "cut": True, "stderr": "done\n"}


def test_agent_failures_are_the_workloads(client: dsec.Client, workers: Workers) -> None:
    workers.start()
    bug, missing = client.rollouts.submit([
        dsec.RolloutSpec(agent="tests.rollout_agents:broken", args=BUSYBOX),
        dsec.RolloutSpec(agent="tests.rollout_agents:no_such_agent")])
    a, b = _finished(client, [bug.id, missing.id])
    assert a.state == "failed" and a.failure == "workload" and "a bug in the agent" in (a.error or "")
    assert b.state == "failed" and b.failure == "workload" and "no_such_agent" in (b.error or "")
    assert not [s for s in client.list(labels={"dsec.rollout": a.id}) if s.state == "running"]


def test_recorded_note_and_cancel(client: dsec.Client, workers: Workers) -> None:
    queued = client.rollouts.submit([dsec.RolloutSpec(agent="tests.rollout_agents:noted")])[0]
    assert client.rollouts.cancel(queued.id).state == "cancelled"
    workers.start()
    rid = client.rollouts.submit([dsec.RolloutSpec(agent="tests.rollout_agents:noted")])[0].id
    (r,) = _finished(client, [rid])
    steps = client.rollouts.get(rid, steps=True).steps or []
    assert r.state == "done" and steps[0].kind == "note" and r.reward == steps[0].response
    long = client.rollouts.submit([dsec.RolloutSpec(agent="tests.rollout_agents:turns", args=BUSYBOX,
                                                    task={"turns": 30, "sleep": 1})])[0].id
    _wait(lambda: client.rollouts.get(long).n_steps >= 1, 60, "a step")
    assert client.rollouts.cancel(long).state == "cancelled"
    _wait(lambda: not [s for s in client.list(labels={"dsec.rollout": long}) if s.state == "running"], 30,
          "its sandbox to stop")
    time.sleep(2)
    assert client.rollouts.get(long).state == "cancelled"
    assert client.rollouts.get(queued.id).state == "cancelled"


def test_bad_specs_and_other_projects(client: dsec.Client, platform: Platform) -> None:
    h = {"Authorization": f"Bearer {TOKEN}"}
    r = httpx.post(f"{platform.url}/v1/rollouts", headers=h, json={"rollouts": [{"agent": "not a ref"}]})
    assert r.status_code == 400 and r.json()["field"] == "rollouts.0.agent"
    r = httpx.post(f"{platform.url}/v1/rollouts", headers=h, json={"rollouts": [{"agent": "m:f", "key": "a b"}]})
    assert r.status_code == 400 and "key" in r.json()["field"]
    r = httpx.post(f"{platform.url}/v1/rollouts", headers=h, json={"rollouts": []})
    assert r.status_code == 400
    r = httpx.post(f"{platform.url}/v1/rollouts", headers=h, json={"rollouts": [{"agent": "m:f", "inference": {
        "base_url": "ftp://x"}}]})
    assert r.status_code == 400 and "base_url" in r.json()["message"]
    assert httpx.get(f"{platform.url}/v1/rollouts/ro-nope", headers=h).status_code == 404
    secret = client.rollouts.submit([dsec.RolloutSpec(agent="m:f", key=_key(), inference=dsec.Inference(
        base_url="http://127.0.0.1:9/v1", api_key="sk-secret"))])[0]
    shown = client.rollouts.get(secret.id, spec=True)
    assert shown.spec is not None and shown.spec.inference is not None and shown.spec.inference.api_key == "***"
    other = client.create_token("rollout-other", "runner").token
    with dsec.Client(url=platform.url, token=other) as c2:
        with pytest.raises(dsec.NotFound):
            c2.rollouts.get(secret.id)
        assert secret.id not in {x.id for x in c2.rollouts.list()}
        with pytest.raises(dsec.NotFound):
            c2.rollouts.cancel(secret.id)
        # a worker of that project never claims this project's rollouts
        got = c2._inner and httpx.post(f"{platform.url}/v1/rollouts/claim", json={"worker": "w", "n": 100},
                                       headers={"Authorization": f"Bearer {other}"}).json()
        assert secret.id not in {x["rollout"]["id"] for x in got}
    client.rollouts.cancel(secret.id)


def test_preemption_pauses_and_resumes_the_job(client: dsec.Client, platform: Platform) -> None:
    """A trainer under ``Preemptible`` gets SIGTERM: the job is paused and it exits 143; the
    next trainer resumes the job on entry."""
    name = f"pre-{uuid.uuid4().hex[:8]}"
    job = client.create_job(name)
    job.run(BUSYBOX)
    script = ("import asyncio, sys, dsec\n"
              "from dsec.client.rl import Preemptible\n"
              "async def main():\n"
              f"    async with dsec.AsyncClient(url={platform.url!r}, token={TOKEN!r}) as c:\n"
              f"        async with Preemptible(c, {name!r}) as job:\n"
              "            print(job.info.state, flush=True)\n"
              "            await asyncio.sleep(3600)\n"
              "asyncio.run(main())\n")
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, cwd=REPO)
    assert p.stdout is not None
    assert p.stdout.readline().strip() == b"active"
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) == 143
    assert client.job(name).info.state == "paused"
    assert [s.state for s in job.sandboxes()] == [dsec.SandboxState.paused]
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, cwd=REPO)
    assert p.stdout is not None
    try:
        assert p.stdout.readline().strip() == b"active"
        assert client.job(name).info.state == "active"
        assert [s.state for s in job.sandboxes()] == [dsec.SandboxState.running]
    finally:
        p.kill()
        p.wait()
    job.stop()
