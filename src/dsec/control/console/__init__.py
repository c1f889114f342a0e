"""The web console and the fleet's at-a-glance views (docs/console.md): the fleet's recent
history the apiserver samples (series), browser sessions exchanged for a token (session),
and the single-page app it serves (web, with its static files in control/console/static).
The sandbox query every edge answers is dsec.shared.query."""
