"""A real MooseFS cluster on this machine (the shared layer store of the tests, the cluster
demo and the benchmarks): a master, one chunkserver and the FUSE client (mfsmount), from
Debian's moosefs packages.

MooseFS refuses loopback addresses for the master<->chunkserver link, so those two
listen on this host's own first global IPv4 address (nothing outside the host is
contacted); the client talks to the master over loopback, or, on a namespace bed
(dsec.control.cluster.netbed), from one of the bed's hosts to the machine's address on the bridge.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Sequence


def host_address() -> str:
    out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        return line.split()[3].split("/")[0]
    raise RuntimeError("MooseFS needs a non-loopback address on this host and there is none")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class MooseFS:
    def __init__(self, root: str, client_host: str = "127.0.0.1", client_net: str = "127.0.0.1",
                 mount_via: Sequence[str] = ()) -> None:
        """``client_host``: the address the master takes clients on, admitting ``client_net``
        (an address or a CIDR); ``mount_via``: a prefix for the mount command (the mount
        made from another host of a namespace bed: ``nsenter --net=...``)."""
        self.root = root
        self.mount = os.path.join(root, "mnt")
        self.ip = host_address()
        self.client_host, self.client_net, self.mount_via = client_host, client_net, list(mount_via)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self) -> None:
        r = self.root
        for d in ("master", "cs", "hdd", "mnt"):
            os.makedirs(os.path.join(r, d), exist_ok=True)
        ml, mcs = _free_port("127.0.0.1"), _free_port(self.ip)
        self.cl_port, cs_port = _free_port(self.client_host), _free_port(self.ip)
        with open(os.path.join(r, "master.cfg"), "w") as f:
            f.write(f"WORKING_USER = root\nWORKING_GROUP = root\nDATA_PATH = {r}/master\n"
                    f"EXPORTS_FILENAME = {r}/exports.cfg\nTOPOLOGY_FILENAME = {r}/topology.cfg\n"
                    f"MATOML_LISTEN_HOST = 127.0.0.1\nMATOML_LISTEN_PORT = {ml}\n"
                    f"MATOCS_LISTEN_HOST = {self.ip}\nMATOCS_LISTEN_PORT = {mcs}\n"
                    f"MATOCL_LISTEN_HOST = {self.client_host}\nMATOCL_LISTEN_PORT = {self.cl_port}\nNICE_LEVEL = 0\n")
        with open(os.path.join(r, "exports.cfg"), "w") as f:
            f.write(f"{self.client_net} / rw,alldirs,maproot=0\n")
        open(os.path.join(r, "topology.cfg"), "w").close()
        if not any(n.startswith("metadata.mfs") for n in os.listdir(os.path.join(r, "master"))):
            with open(os.path.join(r, "master", "metadata.mfs"), "wb") as f:  # a new, empty filesystem
                f.write(b"MFSM NEW")
        with open(os.path.join(r, "cs.cfg"), "w") as f:
            f.write(f"WORKING_USER = root\nWORKING_GROUP = root\nDATA_PATH = {r}/cs\nHDD_CONF_FILENAME = {r}/hdd.cfg\n"
                    f"MASTER_HOST = {self.ip}\nMASTER_PORT = {mcs}\nBIND_HOST = {self.ip}\n"
                    f"CSSERV_LISTEN_HOST = {self.ip}\nCSSERV_LISTEN_PORT = {cs_port}\n"
                    "HDD_LEAVE_SPACE_DEFAULT = 256MiB\nNICE_LEVEL = 0\n")
        with open(os.path.join(r, "hdd.cfg"), "w") as f:
            f.write(f"{r}/hdd\n")
        log = open(os.path.join(r, "moosefs.log"), "ab")  # noqa: SIM115
        self.procs["master"] = subprocess.Popen(["mfsmaster", "-f", "-c", f"{r}/master.cfg", "start"],
                                                stdout=log, stderr=log, start_new_session=True)
        self.procs["chunkserver"] = subprocess.Popen(["mfschunkserver", "-f", "-c", f"{r}/cs.cfg", "start"],
                                                     stdout=log, stderr=log, start_new_session=True)
        deadline = time.time() + 30
        while True:
            p = subprocess.run([*self.mount_via, "mfsmount", self.mount, "-H", self.client_host, "-P",
                                str(self.cl_port)], capture_output=True)
            if p.returncode == 0 or time.time() > deadline:
                break
            time.sleep(0.5)
        if not os.path.ismount(self.mount):
            raise RuntimeError(f"mfsmount failed: {p.stderr.decode()[-300:]}")
        # writable once the chunkserver has registered its disk with the master
        probe = os.path.join(self.mount, ".probe")
        while time.time() < deadline:
            try:
                with open(probe, "wb") as f:
                    f.write(b"x" * 4096)
                os.unlink(probe)
                return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError("MooseFS chunkserver never became writable")

    def stall_chunkserver(self) -> None:
        """The data servers stop answering (as a hung or partitioned storage node does)."""
        os.kill(self.procs["chunkserver"].pid, signal.SIGSTOP)

    def resume_chunkserver(self) -> None:
        os.kill(self.procs["chunkserver"].pid, signal.SIGCONT)

    def stop(self) -> None:
        self.resume_chunkserver()
        subprocess.run(["umount", "-l", self.mount], capture_output=True)
        # end the FUSE client too: a file still open on the detached mount then fails
        # instead of hanging once the master is gone
        subprocess.run(["pkill", "-f", f"mfsmount.*{re.escape(self.mount)}"], capture_output=True)
        for name in ("chunkserver", "master"):
            p = self.procs.pop(name, None)
            if p is None:
                continue
            p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
