"""Daytona's API on dsec, for the unmodified ``daytona`` SDK (``DAYTONA_API_URL=
http://APISERVER/daytona``, a dsec token as ``DAYTONA_API_KEY``).

This package owns dsec's Daytona face: the wire models (models.py), the error envelope
and body handling (http.py), the control plane and its auth (face.py: sandboxes,
preview links) and the toolbox (toolbox.py: exec, code_run, sessions, files, git).
What differs from Daytona is in docs/harnesses.md. Nothing here imports daytona.
"""

from dsec.faces.daytona.face import PREFIX, DaytonaFace, mount

__all__ = ["PREFIX", "DaytonaFace", "mount"]
