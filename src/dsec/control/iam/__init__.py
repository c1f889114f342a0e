"""Identity and access: API tokens scoped to a project and a role.

``admin`` (the node's own token) may do everything in every project; ``builder`` runs
sandboxes and publishes environments (pack_diff, layer changes); ``runner`` runs sandboxes
and rollouts in published environments but cannot publish or change any. A non-admin
token sees and touches only its project's sandboxes.
"""

from dsec.control.iam.tokens import (
    ADMIN,
    Principal,
    TokenStore,
    acting_project,
    current_principal,
    permission_for,
    project_scope,
)

# the project label and a sandbox's project are the wire's: an edge filters by them too
from dsec.shared.wire.iam import PROJECT_LABEL, project_of_sandbox

__all__ = ["ADMIN", "PROJECT_LABEL", "Principal", "TokenStore", "acting_project", "current_principal",
           "permission_for", "project_of_sandbox", "project_scope"]
