"""Running one command in a sandbox through its agent: audited and shown to the command
detectors first, counted while it runs (a pause waits for it), timed, and its failures
told apart (the sandbox's init not answering, a stop under it). Plain and keyed execs
(dsec.node.edge.interactive, dsec.node.edge.keyed) both end here."""

from __future__ import annotations

from dsec.node.agent.aether import Aether, OnData
from dsec.node.agent.initclient import ChannelLost
from dsec.node.edge.core import EdgeNode
from dsec.node.edge.metrics import EdgeMetrics
from dsec.node.edge.sandbox import Sandbox
from dsec.shared.errors import DeadlineExceeded, SandboxNotRunning
from dsec.shared.wire.models import ExecRequest, ExecResult


class CommandRunner:
    """One command, run (see the module's docstring)."""

    def __init__(self, node: EdgeNode, metrics: EdgeMetrics) -> None:
        self.node = node
        self.metrics = metrics

    async def run(self, sb: Sandbox, agent: Aether, req: ExecRequest, on_data: OnData | None) -> ExecResult:
        sandbox_id = sb.id
        cmd = req.cmd if req.cmd is not None else " ".join(req.argv or [])
        self.node.audit.record(sb.id, "exec", f"[{req.session}] {cmd}" if req.session else cmd)
        self.node.detectors.command(sb.id, cmd)
        sb.ops += 1
        self.node.signals.execs += 1
        try:
            res = await agent.exec(req, on_data)
            if res.stdout_truncated or res.stderr_truncated:
                self.node.on_event(sb.id, "output_truncated", f"output past {req.max_output_bytes} bytes was dropped "
                              f"(the command went on{', until its timeout' if res.timed_out else ''})")
            self.metrics.exec_seconds.labels(self.node.name, "session" if req.session else "exec").observe(
                res.duration_ms / 1000)
            return res
        except DeadlineExceeded:  # the sandbox's init did not answer in time
            self.node.signals.agent_deadline_misses += 1
            self.node.signals.exec_failures += 1
            raise
        except ChannelLost:
            if sb.stopping:  # stopped while the command ran
                raise SandboxNotRunning(f"sandbox {sandbox_id} was stopped while the command ran") from None
            self.node.signals.exec_failures += 1
            raise
        finally:
            sb.ops -= 1
