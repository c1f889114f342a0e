"""SandboxFusion's API (``POST /run_code``, ``GET /v1/ping``) served by dsec's FnCall, so
verl's code rewards and tools, skyrl-agent and the ``sandbox-fusion`` client switch to
dsec by changing a URL: ``http://HOST:7777/sandboxfusion/<token>/run_code``.

This package owns the translation between SandboxFusion's wire format (:mod:`.models`)
and FnCall's, and the ``/sandboxfusion`` prefix of the apiserver with its
token-in-the-URL authentication (:mod:`.face`). It runs nothing itself: every request
is one FnCall call on the edge's warm pool.
"""

from dsec.faces.sandboxfusion.face import SandboxFusionFace, mount

__all__ = ["SandboxFusionFace", "mount"]
