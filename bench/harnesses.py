"""Harnesses on dsec, each against its baseline in the same run:

- E2B template builds (``Template.build`` from the official SDK): a cold build and a cached
  rebuild of the same steps, against the same steps run by hand in a fresh sandbox (create,
  upload, exec: what a harness without template builds does per environment);
- SandboxFusion's ``/run_code`` against dsec's own FnCall API (bench/sandboxfusion.py);
- a Harbor trial (``harbor run --env e2b --agent oracle``), its wall time split into
  template build, sandbox create, agent and verifier, cold (build) and warm (tag found);
- the SDKs side by side on one server: Daytona's and E2B's (dsec's faces) and dsec's own,
  create to first command, an exec round trip, and delete (``--only-sdks`` runs just these).

    .venv/bin/python bench/harnesses.py --write docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

_BENCH = os.path.dirname(os.path.abspath(__file__))
# the bench dir goes after site-packages: bench/e2b.py must not hide the E2B SDK
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != _BENCH] + [_BENCH]

from container import private_server, report  # noqa: E402

import dsec  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CTX = os.path.join(ROOT, "tests", "templates_ctx")
STEPS = ["pip install --break-system-packages --no-cache-dir six==1.16.0",
         "python3 -c 'import six' && mkdir -p /app/cache && echo done > /app/cache/ok"]


def _template(nonce: str) -> object:
    from e2b import Template
    t = Template(file_context_path=CTX).from_image("debian:12").set_envs({"NONCE": nonce})
    t = t.run_cmd(STEPS[0]).copy("app/", "/app").run_cmd(STEPS[1])
    return t


def template_builds(rounds: int) -> list[tuple[str, float, float]]:
    """(what, median s, ratio to the by-hand baseline)."""
    from e2b import Template
    by_hand, cold, cached = [], [], []
    files = {f"/app/{n}": open(os.path.join(CTX, "app", n), "rb").read() for n in os.listdir(os.path.join(CTX, "app"))}
    with dsec.Client(url=os.environ["E2B_API_URL"], token=os.environ["E2B_API_KEY"]) as c:
        for i in range(rounds):
            t0 = time.monotonic()
            sb = c.run_container(dsec.ContainerArgs(image="base/debian:12", network_rules={"pypi": True}),
                                 timeout=120)
            try:
                r = sb.exec(STEPS[0], timeout=600)
                assert r.exit_code == 0, r.stderr
                for path, data in files.items():
                    sb.write_file(path, data)
                assert sb.exec(STEPS[1]).exit_code == 0
            finally:
                sb.stop()
            by_hand.append(time.monotonic() - t0)
            nonce = f"{time.time_ns()}-{i}"
            t0 = time.monotonic()
            Template.build(_template(nonce), f"bench-tpl-{i}")
            cold.append(time.monotonic() - t0)
            t0 = time.monotonic()
            Template.build(_template(nonce), f"bench-tpl-{i}")
            cached.append(time.monotonic() - t0)
    base = statistics.median(by_hand)
    return [(what, statistics.median(xs), statistics.median(xs) / base) for what, xs in
            (("same steps by hand in a fresh sandbox (baseline)", by_hand), ("template build, cold", cold),
             ("template build, cached (same steps again)", cached))]


def _span(timing: dict[str, str] | None) -> float:
    if not timing or not timing.get("started_at") or not timing.get("finished_at"):
        return 0.0
    def at(s: str) -> float:
        return datetime.datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()
    return at(timing["finished_at"]) - at(timing["started_at"])


def harbor_trials(url: str, token: str) -> list[tuple[str, dict[str, float]]]:
    subprocess.run(["bash", os.path.join(ROOT, "scripts", "harbor-env.sh")], check=True, capture_output=True)
    task = os.path.join(ROOT, "tests", "harbor", "tasks", "pip-ok")
    env = {**os.environ, "E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_API_KEY": token}
    out = []
    with tempfile.TemporaryDirectory(prefix="dsec-bench-harbor-") as jobs:
        for label in ("cold (builds the template)", "warm (its tag found)"):
            job = f"bench-{len(out)}"
            t0 = time.monotonic()
            subprocess.run([os.path.join(ROOT, "scripts", "harbor"), "run", "--env", "e2b", "--agent", "oracle",
                            "--jobs-dir", jobs, "--job-name", job, "--yes", "--quiet", "--path", task],
                           env=env, check=True, capture_output=True, timeout=900, cwd=ROOT)
            wall = time.monotonic() - t0
            (path,) = glob.glob(os.path.join(jobs, job, "*", "result.json"))
            with open(path) as f:
                r = json.load(f)
            assert r["verifier_result"]["rewards"] == {"reward": 1.0}, r
            out.append((label, {"wall": wall, "environment": _span(r.get("environment_setup")),
                                "agent": _span(r.get("agent_execution")), "verify": _span(r.get("verifier"))}))
    builds = _build_times(url, token)
    if builds:
        out[0][1]["build"] = builds[0]
    return out


def _build_times(url: str, token: str) -> list[float]:
    import httpx
    h = {"X-API-Key": token}
    times = []
    for t in httpx.get(f"{url}/templates", headers=h).json():
        if t["names"][0].startswith("harbor-"):
            for b in httpx.get(f"{url}/templates/{t['templateID']}", headers=h).json()["builds"]:
                if b.get("finishedAt"):
                    def at(s: str) -> float:
                        return datetime.datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()
                    times.append(at(b["finishedAt"]) - at(b["createdAt"]))
    return times


def _median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1000


def sdk_round_trips(url: str, token: str, rounds: int, execs: int = 20) -> list[tuple[str, float, float, float]]:
    """(SDK, create-to-first-command ms, exec round trip ms, delete ms), medians, through each
    SDK unmodified against the same server and the same stack (E2B's ``base``): what an RL
    backend pays per episode and per step."""
    from daytona import CreateSandboxFromSnapshotParams, Daytona, DaytonaConfig
    from e2b import Sandbox as E2BSandbox

    from dsec.faces.e2b.template import BASE_IMAGE, USER_LAYER

    def run(create, exec_, delete) -> tuple[float, float, float]:  # type: ignore[no-untyped-def]
        firsts, steps, deletes = [], [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            sb = create()
            exec_(sb)
            firsts.append(time.perf_counter() - t0)
            for _ in range(execs):
                t1 = time.perf_counter()
                exec_(sb)
                steps.append(time.perf_counter() - t1)
            t2 = time.perf_counter()
            delete(sb)
            deletes.append(time.perf_counter() - t2)
        return _median_ms(firsts), _median_ms(steps), _median_ms(deletes)

    dtn = Daytona(DaytonaConfig(api_key=token, api_url=f"{url}/daytona", target="dsec"))
    out = [("daytona (dsec's Daytona face)", *run(
        lambda: dtn.create(CreateSandboxFromSnapshotParams(snapshot="base")),
        lambda sb: sb.process.exec("true"), lambda sb: dtn.delete(sb)))]
    out.append(("e2b (dsec's E2B face)", *run(
        lambda: E2BSandbox.create("base", api_key=token),
        lambda sb: sb.commands.run("true"), lambda sb: sb.kill())))
    with dsec.Client(url=url, token=token) as c:
        out.append(("dsec SDK", *run(
            lambda: c.run_container(dsec.ContainerArgs(image=BASE_IMAGE, layers=[USER_LAYER])),  # "base"
            lambda sb: sb.exec("true"), lambda sb: sb.stop())))
    return out


def sdk_lines(url: str, token: str, rounds: int) -> list[str]:
    rows = sdk_round_trips(url, token, rounds)
    base = rows[-1]
    lines = ["### SDKs on one server: create to first command, exec round trip (`true`), delete", "",
             "| SDK | create+first exec ms | vs dsec | exec ms | vs dsec | delete ms |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, first, step, delete in rows:
        lines.append(f"| {name} | {first:.1f} | {first / base[1]:.2f}x | {step:.2f} | {step / base[2]:.2f}x "
                     f"| {delete:.1f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--data-dir", default=os.environ.get("DSEC_DATA_DIR", "/var/lib/dsec"))
    ap.add_argument("--skip-harbor", action="store_true")
    ap.add_argument("--only-sdks", action="store_true", help="only the SDKs' create and exec comparison")
    ap.add_argument("--write", metavar="MARKDOWN", help="replace this benchmark's section in that file")
    a = ap.parse_args()
    proc, url, token, _ = private_server(a.data_dir)
    os.environ.update({"E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_API_KEY": token})
    lines = [f"Machine: {os.cpu_count()} cores. Medians of {a.rounds} rounds.", ""]
    try:
        lines += sdk_lines(url, token, a.rounds) + [""]
        print("\n".join(lines), flush=True)
        if a.only_sdks:
            return
        lines += ["### E2B template builds", "", "| what | median s | vs baseline |", "|---|---:|---:|"]
        for what, s, ratio in template_builds(a.rounds):
            lines.append(f"| {what} | {s:.2f} | {ratio:.2f}x |")
        try:
            from sandboxfusion import fusion_vs_fncall
        except ImportError:
            fusion_vs_fncall = None
        if fusion_vs_fncall is not None:
            lines += ["", "### SandboxFusion `/run_code` vs dsec FnCall (python hello)", "",
                      fusion_vs_fncall(url, token)]
        if not a.skip_harbor:
            lines += ["", "### Harbor trial (`harbor run --env e2b --agent oracle`, task pip-ok)", "",
                      "| trial | wall s | template build s | environment (build + create) s | agent s | verifier s "
                      "| Harbor's own (start, uploads, results) s |",
                      "|---|---:|---:|---:|---:|---:|---:|"]
            for label, t in harbor_trials(url, token):
                build = f"{t['build']:.2f}" if "build" in t else "0 (tag found)"
                own = t["wall"] - t["environment"] - t["agent"] - t["verify"]
                lines.append(f"| {label} | {t['wall']:.2f} | {build} | {t['environment']:.2f} | {t['agent']:.2f} "
                             f"| {t['verify']:.2f} | {own:.2f} |")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    report("\n".join(lines), a.write, "harnesses.py", "harnesses", "Harnesses (`bench/harnesses.py`)")


if __name__ == "__main__":
    main()
