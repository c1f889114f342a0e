"""SWE-ReX's remote runtime protocol, served per sandbox by the apiserver.

This package owns dsec's SWE-ReX face: the wire models (models.py, mirroring swe-rex
1.4.0), the HTTP endpoints and their auth and error shapes (face.py), the scripts that
make a SWE-ReX session out of a dsec shell session (shell.py), and directory uploads
(upload.py). SWE-agent's ``RemoteDeployment`` / ``RemoteRuntime`` reach a sandbox at
``http://APISERVER/swerex/<sandbox_id>``; see docs/harnesses.md. Nothing here imports
swerex: it is the client's package, not dsec's.
"""

from dsec.faces.swerex.face import PREFIX, SwerexFace, mount

__all__ = ["PREFIX", "SwerexFace", "mount"]
