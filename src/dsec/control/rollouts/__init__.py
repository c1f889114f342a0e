"""The rollout service's state: rollouts and their journals in the metadata database (store)."""
