"""Batch creates: records in the metadata database (store) and the apiserver's queue that
makes their items a bounded number at a time per edge, fair across jobs (runner)."""

from dsec.control.batches.runner import BatchRunner
from dsec.control.batches.store import BatchStore

__all__ = ["BatchRunner", "BatchStore"]
