"""Adapters that let agent frameworks use dsec sandboxes as their execution environment.

Each module here targets one framework and imports it only when its class is used, so
``import dsec.client.integrations`` (and dsec itself) never requires any of them:

- ``dsec.client.integrations.mini_swe_agent.DsecEnvironment``: a mini-swe-agent environment
  (``environment_class: dsec.client.integrations.mini_swe_agent.DsecEnvironment``).

SWE-agent needs no adapter: it reaches a sandbox through SWE-ReX's remote runtime,
which the apiserver serves (dsec.faces.swerex).
"""
