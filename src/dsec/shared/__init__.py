"""The shared tier: what every tier speaks. Wire models (wire), the metadata database (meta),
errors, tracing, fault injection, admission arithmetic, the sandbox query and TLS. Imports
nothing else of dsec."""
