"""Hollow sandboxes: a load instrument for the control plane (docs/scale.md), never a
backend a user can choose."""
