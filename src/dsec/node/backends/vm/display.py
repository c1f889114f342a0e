"""A full VM's display and input, through QMP: screenshots (screendump, a PPM turned
into PNG here), key combinations (send-key with QEMU key codes) and pointer clicks
(absolute input events to the VM's virtio tablet)."""

from __future__ import annotations

import asyncio
import os
import re
import struct
import zlib

from dsec.node.backends.vm.runtime import VMInstance
from dsec.shared.errors import InvalidRequest, SandboxError

ABS_MAX = 0x7FFF  # QEMU's absolute axis range
_KEY_RE = re.compile(r"^[a-z0-9_]{1,16}$")
_ALIASES = {"enter": "ret", "return": "ret", "space": "spc", "escape": "esc", "del": "delete", "win": "meta_l",
            "super": "meta_l", "control": "ctrl", "pgup": "pgup", "pgdn": "pgdn", "backspace": "backspace"}
BUTTONS = ("left", "right", "middle")


def ppm_to_png(ppm: bytes) -> tuple[bytes, int, int]:
    """A binary PPM (P6, 8-bit) as a PNG; also its width and height."""
    m = re.match(rb"P6\s+(\d+)\s+(\d+)\s+(\d+)\s", ppm)
    if not m or int(m.group(3)) != 255:
        raise SandboxError("QEMU's screendump is not an 8-bit P6 image")
    w, h = int(m.group(1)), int(m.group(2))
    pixels = ppm[m.end():m.end() + w * h * 3]
    if len(pixels) != w * h * 3:
        raise SandboxError("QEMU's screendump is truncated")
    stride = w * 3
    raw = b"".join(b"\0" + pixels[y * stride:(y + 1) * stride] for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))
    return png, w, h


async def _dump(vm: VMInstance) -> bytes:
    if vm.qmp is None:
        raise SandboxError("VM is not running")
    path = os.path.join(vm.dir, "screen.ppm")
    try:
        await vm.qmp.execute("screendump", {"filename": path})
        with open(path, "rb") as f:
            return f.read()
    finally:
        if os.path.exists(path):
            os.unlink(path)


async def screenshot(vm: VMInstance) -> bytes:
    png, w, h = await asyncio.to_thread(ppm_to_png, await _dump(vm))
    vm.timings["screen_w"], vm.timings["screen_h"] = w, h
    return png


def parse_keys(keys: str) -> list[list[str]]:
    """``"ctrl-alt-t ret"``: combinations separated by spaces, keys within one by '-'."""
    combos = []
    for combo in keys.split():
        names = [_ALIASES.get(k.lower(), k.lower()) for k in combo.split("-") if k]
        if not names or len(names) > 6 or not all(_KEY_RE.match(n) for n in names):
            raise InvalidRequest(f"keys: {combo!r} is not a key combination like ctrl-alt-t", field="keys")
        combos.append(names)
    if not combos or len(combos) > 256:
        raise InvalidRequest("keys must hold 1 to 256 combinations", field="keys")
    return combos


async def send_keys(vm: VMInstance, keys: str) -> None:
    if vm.qmp is None:
        raise SandboxError("VM is not running")
    for names in parse_keys(keys):
        try:
            await vm.qmp.execute("send-key", {"keys": [{"type": "qcode", "data": n} for n in names]})
        except SandboxError as e:
            raise InvalidRequest(f"keys: {'-'.join(names)!r}: {e}", field="keys") from None
        await asyncio.sleep(0.02)


async def click(vm: VMInstance, x: int, y: int, button: str = "left") -> None:
    """Move the pointer to pixel (x, y) of the current screen and click ``button``."""
    if button not in BUTTONS:
        raise InvalidRequest(f"button must be one of {', '.join(BUTTONS)}", field="button")
    if vm.qmp is None:
        raise SandboxError("VM is not running")
    if "screen_w" not in vm.timings:
        await screenshot(vm)
    w, h = int(vm.timings["screen_w"]), int(vm.timings["screen_h"])
    if not (0 <= x < w and 0 <= y < h):
        raise InvalidRequest(f"({x}, {y}) is outside the {w}x{h} screen", field="x")
    move = [{"type": "abs", "data": {"axis": "x", "value": x * ABS_MAX // max(w - 1, 1)}},
            {"type": "abs", "data": {"axis": "y", "value": y * ABS_MAX // max(h - 1, 1)}}]
    # to the display the tablet is bound to: the PS/2 mouse would otherwise take the button events
    await vm.qmp.execute("input-send-event", {"device": "video0", "events": move})
    for down in (True, False):
        await vm.qmp.execute("input-send-event", {"device": "video0", "events": [
            {"type": "btn", "data": {"down": down, "button": button}}]})


class VMDisplay:
    """One VM's display as :class:`dsec.node.backends.api.Display` (what its edge is given)."""

    def __init__(self, vm: VMInstance) -> None:
        self.vm = vm

    async def screenshot(self) -> bytes:
        return await screenshot(self.vm)

    async def send_keys(self, keys: str) -> None:
        await send_keys(self.vm, keys)

    async def click(self, x: int, y: int, button: str = "left") -> None:
        await click(self.vm, x, y, button)
