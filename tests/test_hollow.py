"""Hollow edges (``dsec edge hollow``: the real edge over a runtime that starts no process
and mounts nothing; docs/scale.md) pass the lifecycle, admission and record tests real
edges pass: the same test functions as in their own modules (imported, as
tests/test_contract.py does for a remote real edge), run here against an apiserver whose
edge is a hollow one. So the load instrument of bench/scale.py cannot drift from a real
edge. Then what only a hollow edge has: it says so in its stats, answers commands with
exit 0 and no output, and many share one process and leave nothing behind."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

import dsec
from tests.conftest import SECRET, TOKEN, Cluster, stop_all

# the selection: lifecycle, admission (job and project quotas, batches) and records; left
# out are those that read what a process does (output, memory used, mounts and cgroups left)
# or that need creates slow enough to watch a batch rise
from tests.test_api import (  # noqa: F401
    test_commands_on_a_stopped_sandbox_get_409,
    test_create_rejects_bad_args_naming_the_field,
    test_unknown_and_malformed_ids,
)
from tests.test_batches import (  # noqa: F401
    test_items_past_the_job_quota_fail_with_its_reason,
)
from tests.test_jobs import (  # noqa: F401
    test_a_job_without_a_record_is_a_free_form_label,
    test_a_second_job_of_the_same_name_is_refused,
    test_concurrent_creates_never_overshoot,
    test_memory_quota_and_fork_like_batches,
    test_sandbox_quota_is_refused_with_429_naming_it,
)
from tests.test_lifecycle import test_max_lifetime  # noqa: F401


def _hollow_argv(data_root: str, secret_file: str, port: int, count: int = 1, first: int = 1) -> list[str]:
    return ["edge", "hollow", "--count", str(count), "--prefix", "n", "--first", str(first), "--port", str(port),
            "--secret-file", secret_file, "--data-root", data_root]


@pytest.fixture(scope="session")
def hollow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """An apiserver in front of one hollow edge, n1 (``dsec edge hollow``, not ``edge serve``)."""
    c = Cluster(str(tmp_path_factory.mktemp("hollow-edge")))
    e = c.edges["n1"]
    # the node it models is this machine, so its admission answers as a real edge's here
    e.argv = [*_hollow_argv(os.path.join(c.root, "n1"), c.secret_file, e.port), "--cpus", str(os.cpu_count() or 1),
              "--memory-gb", str(max(1, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 30))]
    try:
        c.start()
        yield c
    finally:
        stop_all(c)


@pytest.fixture
def platform(hollow: Cluster) -> Cluster:
    """This module's platform: the apiserver in front of the hollow edge."""
    return hollow


async def test_a_hollow_edge_says_so_and_its_sandboxes_run_nothing(client: dsec.AsyncClient) -> None:
    (node,) = await client.nodes()
    assert node.hollow and node.cpus == os.cpu_count() and [b.value for b in node.backends] == ["container"]
    sb = await client.run_container(dsec.ContainerArgs(image="base/busybox"))
    try:
        r = await sb.exec("echo would-print")
        assert r.exit_code == 0 and r.stdout == "" and r.stderr == ""
        assert (await sb.refresh()).state == dsec.SandboxState.running
        # users cannot ask for it: the backend is not a choice
        async with httpx.AsyncClient() as h:
            bad = await h.post(f"{client.url}/v1/sandboxes", headers={"Authorization": f"Bearer {TOKEN}"},
                               json={"args": {"backend": "hollow", "image": "base/busybox"}})
        assert bad.status_code == 400 and bad.json()["field"] == "backend", bad.text
    finally:
        await sb.stop()
    # its sweepers run: an idle sandbox goes at its TTL, paused and resumed ones keep their state
    idle = await client.run_container(dsec.ContainerArgs(image="base/busybox", ttl_running_stop=1))
    deadline = asyncio.get_running_loop().time() + 10
    while (await idle.refresh()).state == dsec.SandboxState.running:
        assert asyncio.get_running_loop().time() < deadline, "the idle TTL did not stop it"
        await asyncio.sleep(0.2)
    assert (await idle.refresh()).state == dsec.SandboxState.stopped
    held = await client.run_container(dsec.ContainerArgs(image="base/busybox"))
    assert (await held.pause()).state == dsec.SandboxState.paused
    assert (await held.resume()).state == dsec.SandboxState.running
    await held.stop()


def test_many_hollow_edges_share_a_process_and_leave_nothing(tmp_path: os.PathLike[str]) -> None:
    root = os.path.join(tmp_path, "fleet")
    key = os.path.join(tmp_path, "key")
    with open(key, "w") as f:
        f.write(SECRET + "\n")
    proc = subprocess.Popen([sys.executable, "-m", "dsec.client.cli.main",
                             *_hollow_argv(root, key, 0, count=24, first=0)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline().split() for _ in range(24)]
        assert [n for n, _ in lines] == [f"n{i}" for i in range(24)], lines
        auth = {"Authorization": f"Bearer {SECRET}"}
        for _, url in lines:
            assert httpx.get(f"{url}/healthz", headers=auth, timeout=10).status_code == 200
        made = httpx.post(f"{lines[5][1]}/v1/call/create", headers=auth, timeout=30,
                          json={"args": {"backend": "container", "image": "base/busybox"}})
        assert made.status_code == 200 and made.json()["sandbox_id"].startswith("n5-"), made.text
        run_dirs = [f"{hashlib.sha1(os.path.join(root, f'n{i}').encode()).hexdigest()[:8]}-n{i}" for i in range(24)]
        assert all(os.path.isdir(os.path.join("/run/dsec", d)) for d in run_dirs), run_dirs
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
    # a hollow sandbox cannot outlive its edge: the fleet's stop ends it, and nothing is left
    assert not [d for d in run_dirs if os.path.exists(os.path.join("/run/dsec", d))], run_dirs
    assert not [m for m in open("/proc/mounts").read().splitlines() if root in m]
