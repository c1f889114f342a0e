"""The client tier: what a trainer or an operator runs against a platform. The SDK (sdk), the
CLI (cli), RL helpers (rl), the rollout worker (rollouts) and harness integrations
(integrations). May import every tier below."""
