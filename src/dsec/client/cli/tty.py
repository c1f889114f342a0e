"""Client side of ``dsec shell``: the local terminal in raw mode bridged to the
sandbox's TTY websocket (binary frames carry bytes, text frames carry control)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import termios
import tty

import websockets
import websockets.exceptions


async def run_tty(url: str, token: str | None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    loop = asyncio.get_running_loop()
    fd_in = sys.stdin.fileno()
    interactive = os.isatty(fd_in)
    saved = termios.tcgetattr(fd_in) if interactive else None
    code = 1
    try:
        async with websockets.connect(url, additional_headers=headers, max_size=1 << 20) as ws:
            if interactive:
                tty.setraw(fd_in)

                def on_winch() -> None:
                    cols, rows = os.get_terminal_size(fd_in)
                    asyncio.ensure_future(ws.send(json.dumps({"resize": [cols, rows]})))

                loop.add_signal_handler(signal.SIGWINCH, on_winch)
            stdin_q: asyncio.Queue[bytes] = asyncio.Queue()

            def on_stdin() -> None:
                data = os.read(fd_in, 65536)
                stdin_q.put_nowait(data)
                if not data:
                    loop.remove_reader(fd_in)

            loop.add_reader(fd_in, on_stdin)

            async def send() -> None:
                while data := await stdin_q.get():
                    await ws.send(data)

            sender = asyncio.create_task(send())
            try:
                async for msg in ws:
                    if isinstance(msg, bytes):
                        os.write(sys.stdout.fileno(), msg)
                    else:
                        with contextlib.suppress(ValueError, KeyError):
                            code = int(json.loads(msg)["exit"])
            finally:
                sender.cancel()
                loop.remove_reader(fd_in)
    except websockets.exceptions.InvalidStatus as e:
        print(f"\r\ndsec shell: refused: HTTP {e.response.status_code}", file=sys.stderr)
    except OSError as e:
        print(f"\r\ndsec shell: {e}", file=sys.stderr)
    finally:
        if saved is not None:
            termios.tcsetattr(fd_in, termios.TCSADRAIN, saved)
    return code
