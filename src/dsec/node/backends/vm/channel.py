"""The host end of a VM sandbox's agent channel: one byte stream (QEMU's socket for
the guest's virtio-serial port) multiplexed into a control channel and byte
channels, spoken with dsec-vmux in the guest (see dsec-vmux.c for the wire format).

:class:`GuestChannel` offers dsec-init's interface (:class:`dsec.node.agent.initclient.InitClient`):
aether runs exec, sessions and TTYs over it unchanged. Where a container gets the
host's fds over SCM_RIGHTS, here each fd handed to :meth:`spawn` becomes a channel:
the guest makes a pipe, socketpair or pty in its place, and this side pumps bytes
between that channel and the fd. :class:`GuestFiles` does the file operations and
TCP connections aether does through /proc/PID/root and setns for containers.

A guest is hostile: frames for unknown channels are dropped, replies are matched
by request id, and every buffer toward a host fd is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import secrets
import socket
import stat as statmod
import struct
import termios
import tty
from collections.abc import Callable
from dataclasses import dataclass, field

from dsec.node.agent.initclient import CTTY, ChannelLost, SpawnFailed, boottime_ticks, channel
from dsec.node.agent.watch import DirWatch
from dsec.node.backends.vm.qemu import connect_unix
from dsec.shared.errors import DeadlineExceeded, InvalidRequest, NotFound, SandboxError
from dsec.shared.wire.models import FileStat, Owner

# a request to the guest's agent (dsec-vmux) that gets no answer in this long fails; longer
# than a container's init (10 s): these guests may run under TCG
REQUEST_TIMEOUT_S = 30.0
TIOCGPTN = 0x80045430  # _IOR('T', 0x30, unsigned int): a pty master's number; not in Python's termios
MAX_FRAME = 256 * 1024  # what we send; the guest accepts up to 1 MiB
MAX_BUFFER = 64 << 20
_HDR = struct.Struct("<II")


@dataclass
class _Chan:
    id: int
    fd: int | None  # the host fd this channel stands for; None: collected in memory
    to_guest: bool  # we read fd and send
    from_guest: bool  # we write what arrives into fd
    out: bytearray = field(default_factory=bytearray)
    collected: bytearray = field(default_factory=bytearray)
    done: asyncio.Future[None] | None = None
    writer_on: bool = False
    eof_pending: bool = False
    limit: int = MAX_BUFFER


class GuestChannel:
    """Connection to dsec-vmux; one per running VM."""

    def __init__(self, sock_path: str) -> None:
        self.sock_path = sock_path
        self._sock: socket.socket | None = None
        self._rbuf = bytearray()
        self._wbuf = bytearray()
        self._writing = False
        self._next_req = 1
        self._next_ch = 1
        self._replies: dict[str, asyncio.Future[list[bytes]]] = {}
        self._exits: dict[int, asyncio.Future[int]] = {}
        self._chans: dict[int, _Chan] = {}
        self._spawned: dict[int, list[int]] = {}  # pid -> channel per fd position (0: /dev/null)
        self.closed = asyncio.Event()
        self.tick_offset = 0  # guest boottime ticks minus host boottime ticks, at sync

    # ---- connection -----------------------------------------------------------
    async def connect(self, timeout: float = 60.0, alive: Callable[[], bool] | None = None) -> None:
        """Connect to QEMU's end and resynchronise with the guest: everything before
        the guest's marker for our epoch is the leftover of an earlier connection."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            s = await connect_unix(self.sock_path, timeout, alive)
        except ConnectionError as e:
            raise ChannelLost(f"VM agent channel unreachable: {e}") from None
        epoch = secrets.token_hex(8)
        marker = f"DSEC-SYNC:{epoch}:".encode()
        hello = f"0\0V\0{epoch}".encode()
        buf = bytearray()
        next_hello = 0.0
        try:
            while True:
                now = loop.time()
                if now > deadline or (alive is not None and not alive()):
                    raise ChannelLost("the VM's agent did not answer (guest did not boot?)")
                if now >= next_hello:  # until the guest's mux is up, hellos are lost
                    await loop.sock_sendall(s, _HDR.pack(0, len(hello)) + hello)
                    next_hello = now + 0.25
                try:
                    chunk = await asyncio.wait_for(loop.sock_recv(s, 65536), 0.25)
                except TimeoutError:
                    continue
                if not chunk:
                    raise ChannelLost("QEMU closed the agent channel")
                buf += chunk
                i = buf.find(marker)
                if i >= 0:
                    j = buf.find(b"\n", i)
                    if j >= 0:
                        ticks, maxid = (int(x) for x in bytes(buf[i + len(marker):j]).split(b":"))
                        self.tick_offset = ticks - boottime_ticks()
                        self._next_ch = maxid + 1  # the guest kept held channels up to maxid
                        self._rbuf = bytearray(buf[j + 1:])
                        break
                if len(buf) > 1 << 20:
                    del buf[:-128]
        except BaseException:
            s.close()
            raise
        self._sock = s
        loop.add_reader(s.fileno(), self._on_readable)
        if self._rbuf:
            self._parse()

    def detach_socket(self) -> None:
        """The VM is being snapshotted and its QEMU will end: take what QEMU already
        passed on, then let go of the socket, keeping every channel. The guest's side
        of the stream is frozen in its RAM and carries on after :meth:`reattach`."""
        if self._sock is None:
            return
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._sock.fileno())
        if self._writing:
            loop.remove_writer(self._sock.fileno())
            self._writing = False
        while True:
            try:
                chunk = self._sock.recv(1 << 20)
            except (BlockingIOError, OSError):
                break
            if not chunk:
                break
            self._rbuf += chunk
        self._parse()
        self._sock.close()
        self._sock = None

    async def reattach(self, sock_path: str, timeout: float = 30.0) -> None:
        """Continue the stream through a new QEMU (a restored snapshot)."""
        loop = asyncio.get_running_loop()
        try:
            s = await connect_unix(sock_path, timeout)
        except ConnectionError as e:
            self._lost(f"restored VM's agent channel unreachable: {e}")
            raise ChannelLost(f"restored VM's agent channel unreachable: {e}") from None
        self.sock_path = sock_path
        self._sock = s
        loop.add_reader(s.fileno(), self._on_readable)
        self._flush()
        reply = await asyncio.wait_for(self.request("Q"), timeout)
        self.tick_offset = int(reply[1]) - boottime_ticks()

    def _on_readable(self) -> None:
        assert self._sock is not None
        try:
            chunk = self._sock.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._lost()
            return
        self._rbuf += chunk
        self._parse()

    def _parse(self) -> None:
        buf = self._rbuf
        off = 0
        while len(buf) - off >= 8:
            cid, n = _HDR.unpack_from(buf, off)
            if n > (1 << 20) + 64:
                self._lost("the guest sent a malformed frame")
                return
            if len(buf) - off - 8 < n:
                break
            payload = bytes(buf[off + 8:off + 8 + n])
            off += 8 + n
            if cid == 0:
                self._on_control(payload)
            else:
                self._on_data(cid, payload)
        del buf[:off]

    def _on_control(self, payload: bytes) -> None:
        fields = payload.split(b"\0")
        if len(fields) < 2:
            return
        if fields[0] == b"0" and fields[1] == b"X" and len(fields) >= 4:
            with contextlib.suppress(ValueError):
                fut = self._exits.pop(int(fields[2]), None)
                if fut and not fut.done():
                    fut.set_result(int(fields[3]))
            return
        rf = self._replies.pop(fields[0].decode(errors="replace"), None)
        if rf is not None and not rf.done():
            rf.set_result(fields[1:])

    def _lost(self, why: str = "the VM's agent channel was lost") -> None:
        if self._sock is not None:
            loop = asyncio.get_running_loop()
            loop.remove_reader(self._sock.fileno())
            if self._writing:
                loop.remove_writer(self._sock.fileno())
            self._sock.close()
            self._sock = None
        err = ChannelLost(why)
        for f in list(self._replies.values()) + list(self._exits.values()):
            if not f.done():
                f.set_exception(err)
                f.exception()
        self._replies.clear()
        self._exits.clear()
        for c in list(self._chans.values()):
            self._drop(c)
        self.closed.set()

    def close(self) -> None:
        if self._sock is not None:
            self._lost()

    # ---- sending -------------------------------------------------------------
    def _send(self, cid: int, payload: bytes) -> None:
        if self._sock is None:
            raise ChannelLost("the VM's agent channel is closed")
        for i in range(0, max(len(payload), 1), MAX_FRAME):
            part = payload[i:i + MAX_FRAME]
            self._wbuf += _HDR.pack(cid, len(part)) + part
        self._flush()

    def _flush(self) -> None:
        if self._sock is None:
            return
        while self._wbuf:
            try:
                n = self._sock.send(self._wbuf)
            except BlockingIOError:
                break
            except OSError:
                self._lost()
                return
            del self._wbuf[:n]
        loop = asyncio.get_running_loop()
        if self._wbuf and not self._writing:
            loop.add_writer(self._sock.fileno(), self._flush)
            self._writing = True
        elif not self._wbuf and self._writing:
            loop.remove_writer(self._sock.fileno())
            self._writing = False

    async def request(self, *fields: str | int, upload: tuple[int, bytes] | None = None) -> list[bytes]:
        """One control request and its reply, within a deadline (longer for an upload, at
        1 MiB/s even under TCG); ``upload`` (channel, bytes) is sent on that channel, then
        its end, right after the request (a file write)."""
        limit = REQUEST_TIMEOUT_S + (len(upload[1]) >> 20 if upload else 0)
        try:
            async with asyncio.timeout(limit):
                return await self._request(fields, upload)
        except TimeoutError:
            raise DeadlineExceeded(f"the VM's agent did not answer a {str(fields[0])!r} request within "
                                   f"{limit:g} s", operation=str(fields[0])) from None

    async def _request(self, fields: tuple[str | int, ...], upload: tuple[int, bytes] | None) -> list[bytes]:
        rid = str(self._next_req)
        self._next_req += 1
        fut: asyncio.Future[list[bytes]] = asyncio.get_running_loop().create_future()
        self._replies[rid] = fut
        try:
            self._send(0, b"\0".join(str(f).encode() for f in (rid, *fields)))
            if upload is not None:
                cid, data = upload
                for i in range(0, len(data), MAX_FRAME):
                    self._send(cid, data[i:i + MAX_FRAME])
                self._send(cid, b"")
            return await fut
        finally:
            self._replies.pop(rid, None)

    def channel_id(self) -> int:
        cid = self._next_ch
        self._next_ch += 1
        return cid

    def forget(self, cid: int) -> None:
        self._chans.pop(cid, None)

    # ---- byte channels ---------------------------------------------------------
    def new_channel(self, fd: int | None, to_guest: bool, from_guest: bool) -> _Chan:
        c = _Chan(self._next_ch, fd, to_guest, from_guest)
        self._next_ch += 1
        self._chans[c.id] = c
        if fd is not None:
            os.set_blocking(fd, False)
            if to_guest:
                asyncio.get_running_loop().add_reader(fd, self._pump_in, c)
        else:
            c.done = asyncio.get_running_loop().create_future()
        return c

    def _pump_in(self, c: _Chan) -> None:
        assert c.fd is not None
        try:
            data = os.read(c.fd, MAX_FRAME)
        except BlockingIOError:
            return
        except OSError:  # a pty whose other side went away reads EIO
            data = b""
        if data:
            with contextlib.suppress(ChannelLost):
                self._send(c.id, data)
            return
        asyncio.get_running_loop().remove_reader(c.fd)
        c.to_guest = False
        with contextlib.suppress(ChannelLost):
            self._send(c.id, b"")
        self._maybe_drop(c)

    def _on_data(self, cid: int, data: bytes) -> None:
        c = self._chans.get(cid)
        if c is None:
            return
        if not data:  # the guest's side is done with this direction
            if c.fd is None:
                if c.done and not c.done.done():
                    c.done.set_result(None)
                self._chans.pop(cid, None)
                return
            if c.to_guest and not c.from_guest:  # the guest stopped reading: close our side
                asyncio.get_running_loop().remove_reader(c.fd)
                c.to_guest = False
            c.eof_pending = True
            self._write_out(c)
            return
        if c.fd is None:
            if len(c.collected) + len(data) > c.limit:
                if c.done and not c.done.done():
                    c.done.set_exception(InvalidRequest("the guest sent more than the limit", field="path"))
                self._chans.pop(cid, None)
                return
            c.collected += data
            return
        if not c.from_guest:
            return
        if len(c.out) + len(data) > MAX_BUFFER:  # nobody drains the host side: cut it off
            c.from_guest = False
            c.out.clear()
            self._maybe_drop(c)
            return
        c.out += data
        self._write_out(c)

    def _write_out(self, c: _Chan) -> None:
        assert c.fd is not None
        loop = asyncio.get_running_loop()
        while c.out:
            try:
                n = os.write(c.fd, c.out)
            except BlockingIOError:
                break
            except OSError:
                c.out.clear()
                c.from_guest = False
                break
            del c.out[:n]
        if c.out and not c.writer_on:
            loop.add_writer(c.fd, self._write_out, c)
            c.writer_on = True
        elif not c.out and c.writer_on:
            loop.remove_writer(c.fd)
            c.writer_on = False
        if not c.out and c.eof_pending:
            c.eof_pending = False
            c.from_guest = False
            if c.to_guest and statmod.S_ISSOCK(os.fstat(c.fd).st_mode):  # half-close: the other way stays open
                with contextlib.suppress(OSError), socket.socket(fileno=os.dup(c.fd)) as s:
                    s.shutdown(socket.SHUT_WR)
        self._maybe_drop(c)

    def _maybe_drop(self, c: _Chan) -> None:
        if not c.to_guest and not c.from_guest and not c.out:
            self._drop(c)

    def drop_channel(self, c: _Chan) -> None:
        self._drop(c)

    def _drop(self, c: _Chan) -> None:
        self._chans.pop(c.id, None)
        if c.fd is not None:
            loop = asyncio.get_running_loop()
            loop.remove_reader(c.fd)
            if c.writer_on:
                loop.remove_writer(c.fd)
            with contextlib.suppress(OSError):
                os.close(c.fd)
            c.fd = None
        elif c.done and not c.done.done():
            c.done.set_exception(ChannelLost("the VM's agent channel was lost"))
            c.done.exception()

    # ---- dsec-init's interface -----------------------------------------------------
    async def spawn(self, argv: list[str], env: dict[str, str], cwd: str, fds: list[int],
                    flags: int = 1, user: tuple[int, int] | None = None) -> tuple[int, asyncio.Future[int]]:
        """Start ``argv`` in the guest. Each fd becomes a channel: a terminal becomes a
        guest pty, /dev/null stays /dev/null, a pipe end goes the way it was opened,
        a socket given twice goes both ways, else position 0 is what the child reads
        and later positions what it writes."""
        if user not in (None, (0, 0)):
            raise InvalidRequest("running as another user than root is not offered in VM sandboxes yet",
                                 field="user")
        specs: list[str] = []
        seen: dict[int, int] = {}
        made: list[_Chan] = []
        null = os.stat(os.devnull).st_rdev
        try:
            for i, fd in enumerate(fds):
                st = os.fstat(fd)
                if statmod.S_ISCHR(st.st_mode) and st.st_rdev == null:
                    specs.append("n")
                    continue
                if fd in seen:
                    specs.append(specs[fds.index(fd)])
                    continue
                if os.isatty(fd):
                    cols, rows = os.get_terminal_size(fd)
                    tty.setraw(fd, termios.TCSANOW)
                    c = self.new_channel(os.dup(fd), True, True)
                    specs.append(f"t{c.id}:{cols}:{rows}")
                elif statmod.S_ISFIFO(st.st_mode):  # a pipe end says which way it goes
                    writes = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY
                    c = self.new_channel(os.dup(fd), not writes, writes)
                    specs.append(f"{'o' if writes else 'i'}{c.id}")
                elif fds.count(fd) > 1:
                    c = self.new_channel(os.dup(fd), True, True)
                    specs.append(f"b{c.id}")
                elif i == 0:
                    c = self.new_channel(os.dup(fd), True, False)
                    specs.append(f"i{c.id}")
                else:
                    c = self.new_channel(os.dup(fd), False, True)
                    specs.append(f"o{c.id}")
                seen[fd] = c.id
                made.append(c)
            envl = [f"{k}={v}" for k, v in env.items()]
            reply = await self.request("S", len(specs), *specs, flags, cwd, len(argv), *argv, len(envl), *envl)
        except BaseException:
            for c in made:
                self._drop(c)
            raise
        if reply[0] == b"P":
            pid = int(reply[1])
            self._spawned[pid] = [int(sp[1:].split(":")[0]) if sp != "n" else 0 for sp in specs]
            if len(self._spawned) > 4096:  # only the newest matter (a session is held right after its spawn)
                self._spawned.pop(next(iter(self._spawned)))
            fut = self._exits.get(pid)
            if fut is None:
                fut = self._exits[pid] = asyncio.get_running_loop().create_future()
            return pid, fut
        for c in made:
            self._drop(c)
        raise SpawnFailed(int(reply[1]), int(reply[2]) if len(reply) > 2 and reply[2] else 0, argv[0], cwd)

    async def kill_tree(self, pid: int, sig: int, since_ticks: int = 0, include_self: bool = False) -> int:
        # the caller counts ticks on the host's clock; the guest's boot clock is offset
        since = max(0, since_ticks + self.tick_offset - 1) if since_ticks else 0
        reply = await self.request("T", pid, sig, since, 1 if include_self else 0)
        return int(reply[1])

    async def kill_group(self, pgid: int, sig: int) -> None:
        await self.request("G", pgid, sig)

    async def ping(self) -> None:
        await self.request("W")

    # The fd store of a container's init, VM style: the guest holds the *channels* of a
    # session (its shell's pipes stay open in the guest), and a new edge takes them back
    # with fresh host ends. Keys end in "/<pid>" of the spawn whose channels they hold.
    async def hold(self, key: str, fds: list[int]) -> None:
        try:
            ids = self._spawned.get(int(key.rsplit("/", 1)[1]))
        except (IndexError, ValueError):
            ids = None
        if ids is None or len(ids) != len(fds) or 0 in ids:
            return
        reply = await self.request("H", key, *ids)
        if reply[0] != b"K":
            raise SandboxError(f"the VM's agent cannot hold {key}")

    async def retrieve(self, key: str) -> list[int] | None:
        reply = await self.request("R", key)
        if reply[0] != b"F":
            return None
        ours: list[int] = []
        for spec in reply[2:]:
            cid_s, _, kind = spec.decode().partition(":")
            read_end, write_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            read_end.shutdown(socket.SHUT_WR)
            write_end.shutdown(socket.SHUT_RD)
            if kind == "i":  # the child reads: we write, the mux pumps it to the guest
                c = _Chan(int(cid_s), read_end.detach(), True, False)
                ours.append(write_end.detach())
            else:  # the child writes ("x": already gone, an immediate end of file)
                c = _Chan(int(cid_s), write_end.detach(), False, kind == "o")
                ours.append(read_end.detach())
            if kind == "x":
                os.close(c.fd)  # type: ignore[arg-type]
                continue
            self._chans[c.id] = c
            assert c.fd is not None
            os.set_blocking(c.fd, False)
            if c.to_guest:
                asyncio.get_running_loop().add_reader(c.fd, self._pump_in, c)
        return ours

    async def drop(self, key: str) -> None:
        await self.request("D", key)

    async def held_keys(self) -> list[str]:
        reply = await self.request("L")
        return [k.decode(errors="replace") for k in reply[1:] if k]

    def channels(self, n: int) -> list[tuple[int, int]]:
        """The edge's ends of a session's pipes (the guest's are made by the mux)."""
        return [channel() for _ in range(n)]

    async def adopt(self, pid: int) -> asyncio.Future[int] | None:
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._exits[pid] = fut  # before the request: the exit notice may follow the reply at once
        reply = await self.request("A", pid)
        if reply[0] != b"K" or reply[1] != b"0":
            self._exits.pop(pid, None)
            return None
        return fut

    async def resize(self, master: int, cols: int, rows: int) -> None:
        """Resize the guest pty standing for the host pty whose master is ``master``."""
        n = struct.unpack("I", fcntl.ioctl(master, TIOCGPTN, b"\0\0\0\0"))[0]
        for c in list(self._chans.values()):
            if c.fd is not None and os.isatty(c.fd) and os.ttyname(c.fd) == f"/dev/pts/{n}":
                await self.request("Z", c.id, cols, rows)
                return

    async def identity(self, hostname: str, unix_ns: int) -> None:
        await self.request("I", hostname, unix_ns, secrets.token_hex(64))


class GuestFiles:
    """Files and TCP inside a VM sandbox, through dsec-vmux."""

    def __init__(self, ch: GuestChannel) -> None:
        self.ch = ch

    @staticmethod
    def _check(path: str) -> str:
        if not path.startswith("/"):
            raise InvalidRequest("path must be absolute", field="path")
        if "\0" in path:
            raise InvalidRequest("path must not contain NUL", field="path")
        return os.path.normpath(path)

    @staticmethod
    def _raise(reply: list[bytes], path: str) -> None:
        if reply[0] == b"K":
            return
        code = int(reply[1]) if len(reply) > 1 and reply[1].isdigit() else errno.EIO
        if code == errno.ENOENT:
            raise NotFound(f"no such file or directory: {path}", field="path")
        if code == errno.ENOTDIR:
            raise InvalidRequest(f"a component of {path} is not a directory", field="path")
        if code == errno.EISDIR:
            raise InvalidRequest(f"{path} is a directory", field="path")
        if code == errno.EINVAL:
            raise InvalidRequest(f"{path} is not a regular file", field="path")
        raise InvalidRequest(f"{path}: {os.strerror(code)}", field="path")

    async def _collect(self, op: str, path: str, *extra: str | int, limit: int = MAX_BUFFER) -> bytes:
        c = self.ch.new_channel(None, False, True)
        c.limit = limit
        try:
            reply = await self.ch.request(op, c.id, path, *extra)
            if reply[0] == b"E" and len(reply) > 1 and reply[1] == str(errno.EFBIG).encode():
                raise InvalidRequest(f"{path} is larger than the {limit}-byte read limit", field="path")
            self._raise(reply, path)
            assert c.done is not None
            await c.done
            return bytes(c.collected)
        finally:
            self.ch.forget(c.id)

    async def exists(self, path: str) -> bool:
        reply = await self.ch.request("Fs", self._check(path))
        return reply[0] == b"K"

    async def move(self, source: str, destination: str) -> None:
        raise InvalidRequest("moving files is not offered in VM sandboxes yet", field="source")

    async def set_xattrs(self, path: str, prefix: str, values: dict[str, str]) -> None:
        raise InvalidRequest("extended attributes are not offered in VM sandboxes yet", field="path")

    def watch(self, path: str, recursive: bool) -> DirWatch:
        raise InvalidRequest("watching directories is not offered in VM sandboxes yet", field="path")

    async def mkdirs(self, path: str, owner: Owner | None = None) -> None:
        p = self._check(path)
        _root_only(owner)
        self._raise(await self.ch.request("Fm", p), p)

    async def read_file(self, path: str, limit: int) -> bytes:
        return await self._collect("Fr", self._check(path), limit, limit=limit)

    async def write_file(self, path: str, data: bytes, mode: int = 0o644, owner: Owner | None = None) -> None:
        p = self._check(path)
        _root_only(owner)
        if os.path.basename(p) == "":
            raise InvalidRequest("path names the root directory", field="path")
        cid = self.ch.channel_id()
        self._raise(await self.ch.request("Fw", cid, f"{mode:o}", p, upload=(cid, data)), p)

    async def stat(self, path: str) -> FileStat:
        p = self._check(path)
        reply = await self.ch.request("Fs", p)
        self._raise(reply, p)
        name = os.path.basename(p) or "/"
        return _stat_from(p, name, reply[1:6])

    async def list_dir(self, path: str) -> list[FileStat]:
        p = self._check(path)
        raw = await self._collect("Fl", p)
        fields = raw.split(b"\0")
        out = []
        for i in range(0, len(fields) - 5, 6):
            name = fields[i].decode(errors="surrogateescape")
            out.append(_stat_from(os.path.join(p, name), name, fields[i + 1:i + 6]))
        return sorted(out, key=lambda s: s.name)

    async def remove(self, path: str, recursive: bool) -> None:
        p = self._check(path)
        if p == "/":
            raise InvalidRequest("path names the root directory", field="path")
        self._raise(await self.ch.request("Fd", p, 1 if recursive else 0), p)

    async def connect(self, port: int) -> socket.socket:
        """A socket connected to 127.0.0.1:``port`` inside the guest."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        c = self.ch.new_channel(theirs.detach(), True, True)
        try:
            reply = await self.ch.request("C", c.id, port)
        except BaseException:
            self.ch.drop_channel(c)
            mine.close()
            raise
        if reply[0] != b"K":
            self.ch.drop_channel(c)
            mine.close()
            code = int(reply[1]) if len(reply) > 1 and reply[1].isdigit() else errno.EIO
            raise SandboxError(f"nothing answers on port {port} in the sandbox: {os.strerror(code)}")
        return mine


def _root_only(owner: Owner | None) -> None:
    if owner not in (None, (0, 0)):
        raise InvalidRequest("files owned by other users than root are not offered in VM sandboxes yet",
                             field="owner")


def _stat_from(path: str, name: str, f: list[bytes]) -> FileStat:
    kind, size, mode, mtime, target = (x.decode(errors="surrogateescape") for x in f[:5])
    return FileStat(path=path, name=name, type=kind, size=int(size), mode=int(mode, 8),  # type: ignore[arg-type]
                    mtime=float(mtime), link_target=target or None)


__all__ = ["CTTY", "GuestChannel", "GuestFiles"]
