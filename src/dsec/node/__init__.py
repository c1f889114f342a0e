"""The node tier: what runs on each machine. The edge (edge), the sandbox runtimes (backends),
the in-sandbox agent (agent), layers and their storage (layers, storage), checkpoints
(checkpoints) and host setup (host). Imports shared only."""
