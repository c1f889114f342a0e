"""One-shot commands: spawned by dsec-init with socketpairs for stdio, output captured
(bounded) and handed on as it comes, killed with their whole tree at their timeout or
when the caller goes away."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import time

from dsec.node.agent.capture import Capture
from dsec.node.agent.fdio import write_all
from dsec.node.agent.initclient import ChannelLost, SpawnFailed, channel, exit_code
from dsec.node.agent.interfaces import AgentContext, InitChannel, OnData
from dsec.shared.wire.models import ExecRequest, ExecResult

# after a timed-out command is SIGKILLed, how long its answer waits for it to be gone
KILLED_EXIT_WAIT_S = 2.0


async def run_once(init: InitChannel, ctx: AgentContext, req: ExecRequest, on_data: OnData | None) -> ExecResult:
    argv = req.argv if req.argv is not None else [ctx.shell, "-c", req.cmd or ""]
    env = {**ctx.env, **req.env}
    t0 = time.monotonic()
    # socketpairs here too: another process in the sandbox cannot open this command's
    # stdout through /proc to append forged output (say, a fake "5 passed")
    in_r, in_w = channel()
    out_r, out_w = channel()
    err_r, err_w = channel()
    try:
        user = (req.uid, req.uid if req.gid is None else req.gid) if req.uid is not None else None
        pid, exited = await init.spawn(argv, env, req.cwd or ctx.workdir, [in_r, out_w, err_w], user=user)
    except SpawnFailed as e:  # like a shell: 127 for a missing program, 126 otherwise
        for fd in (in_w, out_r, err_r):
            os.close(fd)
        return ExecResult(exit_code=127 if e.errno == errno.ENOENT else 126, stdout="", stderr=e.message + "\n",
                          duration_ms=(time.monotonic() - t0) * 1000)
    except BaseException:
        for fd in (in_w, out_r, err_r):
            os.close(fd)
        raise
    finally:
        for fd in (in_r, out_w, err_w):
            os.close(fd)
    out = Capture(out_r, "stdout", req.max_output_bytes, on_data)
    err = Capture(err_r, "stderr", req.max_output_bytes, on_data)
    feeder = asyncio.create_task(_feed(in_w, (req.stdin or "").encode()))
    timed_out = False
    try:
        await asyncio.wait_for(asyncio.shield(exited), req.timeout_s)
    except TimeoutError:
        timed_out = True
        await init.kill_tree(pid, signal.SIGKILL, 0, include_self=True)
        # a killed task needs CPU time to exit, and a sandbox at its CPU quota may give it
        # little: the answer does not wait for that (init reaps it whenever it ends)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(exited), KILLED_EXIT_WAIT_S)
    except asyncio.CancelledError:  # the caller went away (a dropped stream): the command goes too
        with contextlib.suppress(ChannelLost):
            await asyncio.shield(init.kill_tree(pid, signal.SIGKILL, 0, include_self=True))
        out.close()
        err.close()
        raise
    finally:
        feeder.cancel()
    # output held open by a background grandchild must not hold the caller
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.gather(out.eof.wait(), err.eof.wait()), 0.2)
    out.drain()
    err.drain()
    out.close()
    err.close()
    return ExecResult(
        exit_code=137 if timed_out else exit_code(exited.result()), stdout=out.text(), stderr=err.text(),
        timed_out=timed_out, stdout_truncated=out.truncated, stderr_truncated=err.truncated,
        duration_ms=(time.monotonic() - t0) * 1000)

async def _feed(fd: int, data: bytes) -> None:
    os.set_blocking(fd, False)
    try:
        await write_all(fd, data)
    except OSError:
        pass
    finally:
        os.close(fd)

