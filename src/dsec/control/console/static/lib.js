// Shared by every page: the API client (session cookie, the console's CSRF header), polling
// that pauses while the tab is hidden, formatting, and small components.
import { html, useEffect, useRef, useState } from "/ui/vendor/preact.js";

export class ApiError extends Error {
  constructor(status, body) {
    super(body && body.message ? body.message : `HTTP ${status}`);
    this.status = status;
    this.body = body;
  }
}

let onUnauthorized = () => {};
export function setUnauthorizedHandler(fn) { onUnauthorized = fn; }

export async function api(path, { method = "GET", body, raw = false, headers = {} } = {}) {
  const opts = { method, credentials: "same-origin", headers: { ...headers } };
  if (method !== "GET") opts.headers["X-Dsec-Console"] = "1";
  if (body !== undefined) {
    opts.headers["Content-Type"] = "application/json";
    opts.body = JSON.stringify(body);
  }
  const r = await fetch(path, opts);
  if (r.status === 401) onUnauthorized();
  if (!r.ok) {
    let b = null;
    try { b = await r.json(); } catch (_) { /* not JSON */ }
    throw new ApiError(r.status, b);
  }
  if (raw) return r;
  if (r.status === 204) return null;
  return r.json();
}

export function qs(params) {
  const u = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) {
    if (v === undefined || v === null || v === "") continue;
    if (Array.isArray(v)) v.forEach((x) => u.append(k, x));
    else u.append(k, String(v));
  }
  const s = u.toString();
  return s ? `?${s}` : "";
}

// Calls fn now and every `ms` while the page is visible; the newest answer wins.
export function usePoll(fn, ms, deps = []) {
  const [state, setState] = useState({ data: null, error: null, at: 0 });
  const gen = useRef(0);
  useEffect(() => {
    const mine = ++gen.current;
    let timer = null;
    let stopped = false;
    const tick = async () => {
      if (stopped) return;
      if (!document.hidden) {
        try {
          const data = await fn();
          if (!stopped && gen.current === mine) setState({ data, error: null, at: Date.now() });
        } catch (e) {
          if (!stopped && gen.current === mine) setState((s) => ({ ...s, error: e, at: Date.now() }));
        }
      }
      if (!stopped) timer = setTimeout(tick, ms);
    };
    tick();
    return () => { stopped = true; clearTimeout(timer); };
  }, deps);
  return state;
}

export const fmt = {
  bytes(n) {
    if (n === null || n === undefined) return "–";
    const u = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(n) >= 1024 && i < u.length - 1) { n /= 1024; i++; }
    return `${n.toFixed(i && n < 10 ? 1 : 0)} ${u[i]}`;
  },
  num(n) { return n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US"); },
  pct(x) { return x === null || x === undefined ? "–" : `${x.toFixed(x < 10 ? 1 : 0)}%`; },
  ago(t) {
    if (!t) return "–";
    const s = Math.max(0, Date.now() / 1000 - t);
    if (s < 60) return `${Math.floor(s)}s ago`;
    if (s < 3600) return `${Math.floor(s / 60)}m ago`;
    if (s < 86400) return `${Math.floor(s / 3600)}h ago`;
    return `${Math.floor(s / 86400)}d ago`;
  },
  time(t) { return t ? new Date(t * 1000).toLocaleString() : "–"; },
  dur(s) {
    if (s === null || s === undefined) return "–";
    if (s < 1) return `${(s * 1000).toFixed(0)} ms`;
    if (s < 120) return `${s.toFixed(1)} s`;
    return `${(s / 60).toFixed(1)} min`;
  },
};

export function Badge({ kind, children }) {
  return html`<span class="badge b-${String(kind || children).replace(/[^a-z_]/gi, "")}">${children}</span>`;
}

export function Bar({ value, max = 100, label }) {
  const pct = max > 0 ? Math.min(100, (100 * value) / max) : 0;
  const cls = pct >= 90 ? "hot" : pct >= 70 ? "warm" : "";
  return html`<div class="bar" title=${label || ""}>
    <div class="fill ${cls}" style=${`width:${pct.toFixed(1)}%`}></div>
    <span>${label !== undefined ? label : fmt.pct(pct)}</span></div>`;
}

export function ErrorNote({ error }) {
  if (!error) return null;
  return html`<div class="error" role="alert">${error.message}</div>`;
}

export function Card({ title, children, right }) {
  return html`<section class="card"><header><h3>${title}</h3>${right || null}</header>${children}</section>`;
}

export function Stat({ label, value, sub, testid }) {
  return html`<div class="stat" data-testid=${testid}><div class="v">${value}</div><div class="l">${label}</div>
    ${sub ? html`<div class="s">${sub}</div>` : null}</div>`;
}

export function Tabs({ tabs, active, onPick }) {
  return html`<nav class="tabs">${tabs.map(([id, label]) => html`
    <button class=${id === active ? "on" : ""} data-tab=${id} onClick=${() => onPick(id)}>${label}</button>`)}</nav>`;
}

export function navigate(hash) { window.location.hash = hash; }
