"""E2B compatibility: E2B's control-plane REST API and envd's Connect services served by
dsec, so the official E2B SDKs work against dsec unchanged. See docs/e2b-compat.md."""
