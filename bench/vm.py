"""VM sandboxes: cold boot, template restore, pause/resume and memory per idle VM, with
a bare QEMU boot of the same kernel and initramfs as the baseline, in one run.

- bare QEMU: ``qemu-system-x86_64 -M microvm`` with dsec's kernel and initramfs and the
  probe flag (its /init prints a marker and powers off), no disks, no agent: the floor
  for getting a guest to userspace on this node's accelerator.
- dsec cold boot: ``run_microvm(template=False)`` until a first exec returns (disks,
  overlay root, agent channel, SDK -> API -> edge).
- dsec template restore: ``run_microvm(template=True)`` until a first exec returns (a
  copy of the template's disk, its RAM file mapped private, device state restored).
- pause: ``pause()`` (guest RAM and devices streamed to a checksummed file, QEMU ends);
  resume: the next exec after a pause (checksum check, restore, first exec).
- RSS/PSS of the QEMU process of an idle VM after one exec and a settle, cold-booted vs
  cloned (clones share the template's RAM file pages).

    .venv/bin/python bench/vm.py --write docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

from container import pct, start_server, write_section  # noqa: E402

import dsec  # noqa: E402
from dsec.node.backends.vm.guest import ensure_guest  # noqa: E402
from dsec.node.host.prep import prepare_cgroups  # noqa: E402
from dsec.node.layers.store import LayerStore  # noqa: E402


def bare_boot(kernel: str, initrd: str, accel: str, memory_mb: int) -> float:
    t0 = time.monotonic()
    p = subprocess.run(["qemu-system-x86_64", "-M", "microvm", "-accel", accel, "-m", str(memory_mb),
                        "-kernel", kernel, "-initrd", initrd, "-nodefaults", "-no-user-config", "-nographic",
                        "-no-reboot", "-serial", "stdio", "-append",
                        "console=ttyS0 quiet panic=-1 tsc_early_khz=2600000 dsec.probe=1"],
                       capture_output=True, timeout=120)
    dt = time.monotonic() - t0
    if b"DSEC-PROBE-OK" not in p.stdout:
        raise RuntimeError("bare QEMU boot did not reach /init")
    return dt


def qemu_pid(sandbox_id: str) -> int:
    for cmd in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(cmd, "rb") as f:
                argv = f.read()
        except OSError:
            continue
        if b"qemu-system" in argv.split(b"\0")[0] and sandbox_id.encode() in argv:
            return int(cmd.split("/")[2])
    raise RuntimeError(f"no QEMU for {sandbox_id}")


def memory_kb(pid: int) -> tuple[int, int, int]:
    """(RSS, PSS, USS) of a process, in KiB; USS (private pages only) is what one more VM costs."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if parts[0] in ("Rss:", "Pss:", "Private_Clean:", "Private_Dirty:"):
                out[parts[0]] = int(parts[1])
    return out["Rss:"], out["Pss:"], out["Private_Clean:"] + out["Private_Dirty:"]


def private_data_dir(src: str) -> str:
    """A data dir of our own: the node's layers, guest kernel and accelerator verdict linked in."""
    data_dir = tempfile.mkdtemp(prefix="dsec-bench-")
    LayerStore(os.path.join(data_dir, "layers")).link_from(os.path.join(src, "layers"))
    os.makedirs(os.path.join(data_dir, "vm"))
    subprocess.run(["cp", "-al", os.path.join(src, "vm", "guest"), os.path.join(data_dir, "vm", "guest")], check=True)
    subprocess.run(["cp", os.path.join(src, "vm", "accel.json"), os.path.join(data_dir, "vm")], check=True)
    return data_dir


async def timed_create(c: dsec.AsyncClient, template: bool, memory_mb: int) -> tuple[float, dsec.AsyncSandbox]:
    t0 = time.monotonic()
    vm = await c.run_microvm(dsec.MicroVMArgs(memory_mb=memory_mb, template=template), timeout=300)
    r = await vm.exec("true")
    assert r.exit_code == 0
    return time.monotonic() - t0, vm


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--memory-mb", type=int, default=512)
    ap.add_argument("--data-dir", default=os.environ.get("DSEC_DATA_DIR", "/var/lib/dsec"))
    ap.add_argument("--write", metavar="MARKDOWN")
    a = ap.parse_args()
    prepare_cgroups()
    data_dir = private_data_dir(a.data_dir)
    with open(os.path.join(data_dir, "vm", "accel.json")) as f:
        accel = json.load(f)["accel"]
    guest = ensure_guest(data_dir, "microvm")
    token = "bench-" + os.urandom(8).hex()
    proc, url = start_server(data_dir, token, log=os.path.join(data_dir, "serve.log"))
    res: dict[str, list[float]] = {k: [] for k in ("bare", "cold", "template", "pause", "resume", "template_build")}
    rss: dict[str, list[tuple[int, int, int]]] = {"cold": [], "clone": []}
    snap_mb: list[float] = []
    try:
        async with dsec.AsyncClient(url=url, token=token, timeout=600) as c:
            t0 = time.monotonic()  # the first template use builds it: a cold boot plus a snapshot
            _, vm = await timed_create(c, True, a.memory_mb)
            res["template_build"].append(time.monotonic() - t0)
            await vm.stop()
            for i in range(a.rounds):
                res["bare"].append(await asyncio.to_thread(bare_boot, guest.kernel, guest.initrd, accel, a.memory_mb))
                dt, cold = await timed_create(c, False, a.memory_mb)
                res["cold"].append(dt)
                dt, clone = await timed_create(c, True, a.memory_mb)
                res["template"].append(dt)
                await asyncio.sleep(3)  # idle: let both settle
                rss["cold"].append(memory_kb(qemu_pid(cold.sandbox_id)))
                rss["clone"].append(memory_kb(qemu_pid(clone.sandbox_id)))
                await cold.stop()
                await clone.run_shell("python3 -c 'import json, sqlite3' && echo ok")
                t0 = time.monotonic()
                info = await clone.pause()
                res["pause"].append(time.monotonic() - t0)
                snap_mb.append((info.vm.snapshot_bytes or 0) / 2**20 if info.vm else 0)
                t0 = time.monotonic()
                r = await clone.exec("true")
                res["resume"].append(time.monotonic() - t0)
                assert r.exit_code == 0
                await clone.stop()
                print(i, {k: round(v[-1], 3) for k, v in res.items() if v}, rss["cold"][-1], rss["clone"][-1],
                      flush=True)
    finally:
        proc.terminate()
        proc.wait()
    med = {k: statistics.median(v) for k, v in res.items() if v}
    rc, pc, uc = (statistics.median(x[i] for x in rss["cold"]) for i in range(3))
    rk, pk, uk = (statistics.median(x[i] for x in rss["clone"]) for i in range(3))
    ms = 1000.0
    rows = [
        ("bare QEMU: start, boot to /init, power off (no disks, no agent)", f"{med['bare'] * ms:.0f}",
         "1.00x (baseline)", ""),
        ("dsec cold boot to first exec", f"{med['cold'] * ms:.0f}", f"{med['cold'] / med['bare']:.2f}x", ""),
        ("dsec template restore to first exec", f"{med['template'] * ms:.0f}",
         f"{med['template'] / med['bare']:.2f}x; {med['cold'] / med['template']:.1f}x faster than cold boot",
         "<= 1000"),
        (f"pause ({a.memory_mb} MiB guest; snapshot {statistics.median(snap_mb):.0f} MiB)",
         f"{med['pause'] * ms:.0f}", f"p90 {pct(res['pause'], 90) * ms:.0f}", "<= 1000"),
        ("resume to first exec", f"{med['resume'] * ms:.0f}", f"p90 {pct(res['resume'], 90) * ms:.0f}", ""),
        ("first template build (boot + snapshot, once per shape)", f"{med['template_build'] * ms:.0f}", "", ""),
    ]
    out = [f"{a.rounds} rounds, microVM {a.memory_mb} MiB, 1 vCPU, base/debian:12; accelerator **{accel}**; "
           f"{os.cpu_count()} cores, host kernel {platform.release()}, guest kernel {guest.version}", "",
           "| metric | median (ms) | ratio | target |", "|---|---|---|---|"]
    out += [f"| {n} | {v} | {r} | {t} |" for n, v, r, t in rows]
    out += ["", "| idle VM, QEMU process | RSS (MiB) | PSS (MiB) | USS (MiB) | RSS / PSS / USS vs cold boot | target |",
            "|---|---|---|---|---|---|",
            f"| cold-booted | {rc / 1024:.0f} | {pc / 1024:.0f} | {uc / 1024:.0f} | 1.00 | |",
            f"| cloned from template | {rk / 1024:.0f} | {pk / 1024:.0f} | {uk / 1024:.0f} | "
            f"{rk / rc:.2f} / {pk / pc:.2f} / {uk / uc:.2f} | RSS <= 0.40 |"]
    body = "\n".join(out)
    if a.write:
        body += "\n\n" + figures(res, rss, accel, a.write)
    print(body)
    if a.write:
        write_section(a.write, body, "python bench/vm.py --write docs/benchmarks.md", name="vm",
                      title="VM backends (`bench/vm.py`)")


def figures(res: dict[str, list[float]], rss: dict[str, list[tuple[int, int, int]]], accel: str,
            markdown: str) -> str:
    """Medians (with p90 as error bars) of the timings and the idle VMs' memory, as PNGs beside
    ``markdown``: their markdown links."""
    import plots

    out = plots.img_dir(markdown)
    names = [("bare", "bare QEMU\nboot (baseline)"), ("cold", "dsec cold boot\nto first exec"),
             ("template", "dsec template\nrestore to\nfirst exec"), ("pause", "pause"),
             ("resume", "resume to\nfirst exec")]
    names = [(k, label) for k, label in names if res.get(k)]
    p50 = [statistics.median(res[k]) * 1000 for k, _ in names]
    p90 = [pct(res[k], 90) * 1000 for k, _ in names]
    times = plots.bar_compare([label for _, label in names], {"median": p50},
                              errors={"median": [max(0.0, b - a) for a, b in zip(p50, p90, strict=True)]},
                              bench="vm", name="timings", ylabel="ms", baseline_group=0,
                              title=f"microVM timings, median over {len(res['cold'])} rounds (bar to p90), "
                                    f"accelerator {accel}", out_dir=out)
    mem = {kind: [statistics.median(x[i] for x in rss[key]) / 1024 for i in range(3)]
           for kind, key in (("cold-booted", "cold"), ("cloned from template", "clone"))}
    memory = plots.bar_compare(["RSS", "PSS", "USS (private)"], mem, bench="vm", name="memory",
                               ylabel="MiB", title="Memory of an idle microVM's QEMU process, median", out_dir=out)
    return "\n\n".join([plots.image_link("microVM boot, restore, pause and resume times", times),
                        plots.image_link("memory per idle microVM, cold-booted vs cloned", memory)])


if __name__ == "__main__":
    asyncio.run(main())
