"""Template builds: environments made from build steps (E2B's template API, Dockerfiles
parsed by E2B's SDKs) run in a builder sandbox and published as a dsec layer on their
base, with the step cache, the file contexts, and where a FROM image comes from."""
