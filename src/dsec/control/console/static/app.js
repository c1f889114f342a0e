// The console's shell: log in (a token exchanged for a session cookie), the navigation, and
// a hash router over the pages. Every page reads the API with the session's rights.
import { html, render, useEffect, useState } from "/ui/vendor/preact.js";
import { FleetPage } from "/ui/static/fleet.js";
import { JobPage, JobsPage } from "/ui/static/jobs.js";
import { FnCallPage, LayersPage } from "/ui/static/layers.js";
import { ProjectsPage } from "/ui/static/projects.js";
import { ErrorNote, api, setUnauthorizedHandler } from "/ui/static/lib.js";
import { SandboxPage } from "/ui/static/sandbox.js";
import { SandboxesPage } from "/ui/static/sandboxes.js";

const NAV = [["fleet", "Fleet"], ["sandboxes", "Sandboxes"], ["jobs", "Jobs"], ["layers", "Layers"], ["fncall", "FnCall"],
  ["projects", "Projects"]];

function parseHash() {
  const raw = window.location.hash.replace(/^#\/?/, "");
  const [path, query] = raw.split("?");
  const parts = path.split("/").filter(Boolean).map((p) => {
    try { return decodeURIComponent(p); } catch (_) { return p; }
  });
  return { parts: parts.length ? parts : ["fleet"], params: new URLSearchParams(query || "") };
}

function useRoute() {
  const [route, setRoute] = useState(parseHash());
  useEffect(() => {
    const on = () => setRoute(parseHash());
    window.addEventListener("hashchange", on);
    return () => window.removeEventListener("hashchange", on);
  }, []);
  return route;
}

function Login({ onIn }) {
  const [error, setError] = useState(null);
  const [busy, setBusy] = useState(false);
  const submit = async (e) => {
    e.preventDefault();
    setBusy(true);
    try {
      onIn(await api("/ui/session", { method: "POST", body: { token: e.target.token.value } }));
    } catch (x) { setError(x); }
    setBusy(false);
  };
  return html`<main class="login"><form onSubmit=${submit} class="card">
    <h1>dsec</h1><p class="muted">Paste an API token (the cluster's, or a project's). It is exchanged for a
    session cookie and not kept by the page.</p>
    <input type="password" name="token" placeholder="token" autocomplete="off" autofocus required />
    <button type="submit" disabled=${busy}>Log in</button><${ErrorNote} error=${error} /></form></main>`;
}

function Page({ route }) {
  const [head, arg] = route.parts;
  switch (head) {
    case "sandboxes": return html`<${SandboxesPage} params=${route.params} />`;
    case "sandbox":
      // an id goes into API paths: only what the edges make (edge name, '-', base36)
      if (!/^[a-z0-9][a-z0-9_.-]{0,126}$/i.test(arg || "")) return html`<p class="error">Not a sandbox id.</p>`;
      return html`<${SandboxPage} id=${arg} params=${route.params} key=${arg} />`;
    case "jobs": return html`<${JobsPage} />`;
    case "job": return html`<${JobPage} name=${arg} params=${route.params} key=${arg} />`;
    case "layers": return html`<${LayersPage} />`;
    case "fncall": return html`<${FnCallPage} />`;
    case "projects": return html`<${ProjectsPage} />`;
    default: return html`<${FleetPage} />`;
  }
}

function App() {
  const [me, setMe] = useState(undefined);
  const route = useRoute();
  useEffect(() => {
    setUnauthorizedHandler(() => setMe(null));
    api("/ui/session").then(setMe, () => setMe(null));
  }, []);
  if (me === undefined) return html`<p class="muted pad">&hellip;</p>`;
  if (me === null) return html`<${Login} onIn=${setMe} />`;
  const logout = async () => { await api("/ui/session", { method: "DELETE" }); setMe(null); };
  const section = route.parts[0] === "sandbox" ? "sandboxes" : route.parts[0] === "job" ? "jobs" : route.parts[0];
  return html`
    <header class="top">
      <a class="brand" href="#/fleet">dsec</a>
      <nav>${NAV.map(([id, label]) => html`<a href=${`#/${id}`} class=${section === id ? "on" : ""} data-nav=${id}>${label}</a>`)}</nav>
      <span class="grow"></span>
      <span class="who" data-testid="whoami">${me.project === "*" ? "all projects" : `project ${me.project}`} · ${me.role}</span>
      <button class="link" onClick=${logout}>Log out</button>
    </header>
    <main class="page"><${Page} route=${route} /></main>`;
}

render(html`<${App} />`, document.getElementById("app"));
