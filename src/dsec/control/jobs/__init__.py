"""Jobs: a project's named groups of sandboxes. ``store`` keeps their records in the
metadata database (every apiserver replica serves every job); ``quota`` admits a job's
creates against its quota."""

from dsec.control.jobs.quota import JobGate
from dsec.control.jobs.store import JobStore

__all__ = ["JobGate", "JobStore"]
