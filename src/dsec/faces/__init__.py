"""The face tier: the HTTP faces a client reaches. dsec's own app and its authentication
(front), the compatibility faces (e2b, daytona, sandboxfusion, swerex), template builds
(templates), and embedded mode's assembly (embedded). Imports control, node and shared."""
