// One sandbox: its record, usage over time, events, audit flags, command log, files, a live
// terminal (xterm.js over the API's TTY websocket) and, for a VM, its screen.
import { html, useEffect, useRef, useState } from "/ui/vendor/preact.js";
import { Chart } from "/ui/static/charts.js";
import { Badge, Card, ErrorNote, Tabs, api, fmt, navigate, qs, usePoll } from "/ui/static/lib.js";

const HISTORY = 300; // usage samples kept while the page is open (10 min at 2 s)

export function SandboxPage({ id, params }) {
  const tab = params.get("tab") || "overview";
  const { data: info, error } = usePoll(() => api(`/v1/sandboxes/${id}`), 2000, [id]);
  const [acting, setActing] = useState(null);
  const [actionError, setActionError] = useState(null);
  const act = async (what, fn) => {
    setActing(what);
    setActionError(null);
    try { await fn(); } catch (e) { setActionError(e); }
    setActing(null);
  };
  if (!info) return html`<${ErrorNote} error=${error} /><p class="muted">Loading ${id}&hellip;</p>`;
  const live = info.state === "running" || info.state === "paused";
  const tabs = [["overview", "Overview"], ["terminal", "Terminal"], ["files", "Files"], ["commands", "Command log"],
    ["events", "Events"], ["audit", "Audit"]];
  if (info.backend === "vm") tabs.push(["screen", "Screen"]); // a full VM's display (microVMs have none)
  const pick = (t) => navigate(`#/sandbox/${id}${qs({ tab: t === "overview" ? "" : t })}`);
  return html`
    <div class="head">
      <h2 class="mono" data-testid="sandbox-id">${id}</h2>
      <${Badge} kind=${info.state}><span data-testid="sandbox-state">${info.state}</span><//>
      <span class="muted">${info.backend} on ${info.edge}</span>
      <span class="grow"></span>
      ${info.state === "running" ? html`<button disabled=${!!acting} onClick=${() => act("pause", () => api(`/v1/sandboxes/${id}/pause`, { method: "POST" }))}>Pause</button>` : null}
      ${info.state === "paused" ? html`<button disabled=${!!acting} onClick=${() => act("resume", () => api(`/v1/sandboxes/${id}/resume`, { method: "POST" }))}>Resume</button>` : null}
      ${live ? html`<button class="danger" data-testid="stop" disabled=${!!acting} onClick=${() => {
        if (window.confirm(`Stop ${id}? Its processes and unsaved files are gone.`)) act("stop", () => api(`/v1/sandboxes/${id}`, { method: "DELETE" }));
      }}>Stop</button>` : null}
    </div>
    <${ErrorNote} error=${actionError || error} />
    ${info.error ? html`<div class="error">${info.error}</div>` : null}
    <${Tabs} tabs=${tabs} active=${tab} onPick=${pick} />
    ${tab === "overview" ? html`<${Overview} info=${info} />` : null}
    ${tab === "terminal" ? html`<${Terminal} id=${id} live=${info.state === "running"} />` : null}
    ${tab === "files" ? html`<${Files} id=${id} path=${params.get("path") || "/"} />` : null}
    ${tab === "commands" ? html`<${Commands} id=${id} />` : null}
    ${tab === "events" ? html`<${Events} id=${id} />` : null}
    ${tab === "audit" ? html`<${Audit} id=${id} />` : null}
    ${tab === "screen" ? html`<${Screen} id=${id} />` : null}`;
}

function Overview({ info }) {
  const samples = useRef([]);
  const prev = useRef(null);
  const { data: use, error } = usePoll(async () => {
    const u = await api(`/v1/sandboxes/${info.sandbox_id}/usage`);
    const now = Date.now() / 1000;
    const p = prev.current;
    const cpu = p && now > p.t ? (100 * (u.cpu_s - p.cpu_s)) / (now - p.t) : null;
    prev.current = { t: now, cpu_s: u.cpu_s };
    samples.current = [...samples.current, { at: now, cpu, mem: u.memory_bytes / 2 ** 20, swap: u.swap_bytes / 2 ** 20, pids: u.pids }].slice(-HISTORY);
    return u;
  }, 2000, [info.sandbox_id, info.state === "running" || info.state === "paused"]);
  const s = samples.current;
  const rows = [["image", info.image], ["layers", info.layers.join(", ") || "–"], ["job", info.job || "–"],
    ["labels", Object.entries(info.labels).map(([k, v]) => `${k}=${v}`).join(", ") || "–"],
    ["limits", `${info.cpu_cores_limit} CPU · ${info.memory_limit_mb} MiB memory${info.disk_limit_mb ? ` · ${info.disk_limit_mb} MiB disk` : ""}`],
    ["created", fmt.time(info.created_at)], ["last active", fmt.ago(info.last_active_at)],
    ["expires", info.expires_at ? fmt.time(info.expires_at) : "–"],
    ["checkpoint", info.checkpoint ? `${fmt.ago(info.checkpoint.taken_at)} (#${info.checkpoint.seq}, ${info.checkpoint.kind}; every ${info.checkpoint_every_s || "–"} s)` : "–"],
    ["restored from", info.restored_from || "–"],
    ["network", info.network ? JSON.stringify(info.network) : "–"]];
  return html`
    <div class="grid2">
      <${Card} title="Record"><table class="kv">${rows.map(([k, v]) => html`<tr><th>${k}</th><td>${v}</td></tr>`)}</table><//>
      <${Card} title="Usage now">
        <${ErrorNote} error=${error} />
        ${use ? html`<table class="kv">
          <tr><th>CPU time</th><td>${fmt.dur(use.cpu_s)}</td></tr>
          <tr><th>memory</th><td>${fmt.bytes(use.memory_bytes)} (anon ${fmt.bytes(use.anon_bytes)}, file ${fmt.bytes(use.file_bytes)})</td></tr>
          <tr><th>swap</th><td>${fmt.bytes(use.swap_bytes)}</td></tr>
          <tr><th>processes</th><td>${use.pids}</td></tr>
          <tr><th>disk</th><td>${fmt.bytes(use.disk_bytes)}</td></tr>
          <tr><th>OOM kills</th><td>${use.oom_kills}</td></tr></table>` : html`<p class="muted">&hellip;</p>`}
      <//>
    </div>
    <div class="grid2">
      <${Card} title="CPU"><${Chart} title="% of one CPU" testid="chart-cpu" series=${[{ label: "CPU %" }]}
        data=${[s.map((x) => x.at), s.map((x) => x.cpu)]} height=${150} /><//>
      <${Card} title="Memory"><${Chart} title="MiB" testid="chart-mem" series=${[{ label: "memory" }, { label: "swap", color: "#e67700" }]}
        data=${[s.map((x) => x.at), s.map((x) => x.mem), s.map((x) => x.swap)]} height=${150} /><//>
    </div>`;
}

function Terminal({ id, live }) {
  const box = useRef(null);
  const [status, setStatus] = useState("connecting");
  useEffect(() => {
    if (!live || !box.current) return undefined;
    const term = new window.Terminal({ fontSize: 13, cursorBlink: true, convertEol: false,
      theme: { background: "#111318" } });
    const fit = new window.FitAddon.FitAddon();
    term.loadAddon(fit);
    term.open(box.current);
    fit.fit();
    const proto = window.location.protocol === "https:" ? "wss" : "ws";
    const ws = new WebSocket(`${proto}://${window.location.host}/v1/sandboxes/${id}/tty${qs({ cols: term.cols, rows: term.rows })}`);
    ws.binaryType = "arraybuffer";
    const enc = new TextEncoder();
    ws.onopen = () => { setStatus("connected"); term.focus(); };
    ws.onmessage = (ev) => {
      if (typeof ev.data === "string") {
        const msg = JSON.parse(ev.data);
        if (msg.exit !== undefined) { term.write(`\r\n[the shell exited with ${msg.exit}]\r\n`); setStatus("exited"); }
      } else term.write(new Uint8Array(ev.data));
    };
    ws.onclose = (ev) => setStatus(ev.code >= 4000 ? `closed: ${ev.reason || ev.code}` : "closed");
    const input = term.onData((d) => { if (ws.readyState === 1) ws.send(enc.encode(d)); });
    const onResize = () => {
      fit.fit();
      if (ws.readyState === 1) ws.send(JSON.stringify({ resize: [term.cols, term.rows] }));
    };
    window.addEventListener("resize", onResize);
    window.dsecTerminal = term; // the browser tests read the screen through it
    return () => {
      window.removeEventListener("resize", onResize);
      input.dispose();
      ws.close();
      term.dispose();
    };
  }, [id, live]);
  if (!live) return html`<p class="muted">The terminal needs a running sandbox.</p>`;
  return html`<div class="termwrap"><div class="muted small" data-testid="tty-status">${status}</div>
    <div class="term" ref=${box} data-testid="terminal"></div></div>`;
}

function Files({ id, path }) {
  const [view, setView] = useState(null);
  const { data, error } = usePoll(() => api(`/v1/sandboxes/${id}/files/list${qs({ path })}`), 5000, [id, path]);
  useEffect(() => setView(null), [path]);
  const go = (p) => navigate(`#/sandbox/${id}${qs({ tab: "files", path: p })}`);
  const parts = path.split("/").filter(Boolean);
  const open = async (f) => {
    if (f.type === "dir") return go(f.path);
    if (f.size > 512 * 1024) return setView({ path: f.path, text: null, size: f.size });
    const r = await api(`/v1/sandboxes/${id}/files${qs({ path: f.path })}`, { raw: true });
    const buf = new Uint8Array(await r.arrayBuffer());
    let text = null;
    try { text = new TextDecoder("utf-8", { fatal: true }).decode(buf); } catch (_) { /* binary */ }
    setView({ path: f.path, text, size: buf.length });
  };
  const sorted = data ? [...data].sort((a, b) => (a.type === "dir") === (b.type === "dir") ? a.name.localeCompare(b.name) : a.type === "dir" ? -1 : 1) : [];
  return html`
    <nav class="crumbs"><a href="#" onClick=${(e) => { e.preventDefault(); go("/"); }}>/</a>${parts.map((p, i) => html`
      <a href="#" onClick=${(e) => { e.preventDefault(); go(`/${parts.slice(0, i + 1).join("/")}`); }}>${p}/</a>`)}</nav>
    <${ErrorNote} error=${error} />
    <div class="grid2">
      <${Card} title=${path}>
        <table class="t" data-testid="files"><thead><tr><th>name</th><th>size</th><th>mode</th><th>modified</th></tr></thead>
          <tbody>${parts.length ? html`<tr><td><a href="#" onClick=${(e) => { e.preventDefault(); go(`/${parts.slice(0, -1).join("/")}`); }}>..</a></td><td></td><td></td><td></td></tr>` : null}
          ${sorted.map((f) => html`<tr data-file=${f.name}>
            <td><a href="#" onClick=${(e) => { e.preventDefault(); open(f); }}>${f.name}${f.type === "dir" ? "/" : ""}</a>
              ${f.link_target ? html` <span class="muted">→ ${f.link_target}</span>` : null}</td>
            <td>${f.type === "dir" ? "" : fmt.bytes(f.size)}</td><td class="mono small">${(f.mode & 0o7777).toString(8)}</td>
            <td>${fmt.ago(f.mtime)}</td></tr>`)}</tbody></table>
      <//>
      ${view ? html`<${Card} title=${view.path} right=${html`<a href=${`/v1/sandboxes/${id}/files${qs({ path: view.path })}`} download>download</a>`}>
        ${view.text !== null ? html`<pre class="file" data-testid="file-view">${view.text}</pre>` : html`<p class="muted">${fmt.bytes(view.size)}: binary or too large to show.</p>`}<//>` : null}
    </div>`;
}

function Commands({ id }) {
  const { data, error } = usePoll(() => api(`/v1/sandboxes/${id}/commands${qs({ limit: 1000 })}`), 3000, [id]);
  const [open, setOpen] = useState(null);
  return html`<${ErrorNote} error=${error} /><${Card} title="Command log (keyed commands)">
    ${data && !data.length ? html`<p class="muted">No keyed commands: only commands sent with a key are logged (docs/rl.md).</p>` : null}
    <table class="t"><thead><tr><th>#</th><th>key</th><th>command</th><th>state</th><th>exit</th><th>took</th><th>started</th></tr></thead>
      <tbody>${(data || []).map((c) => html`<tr onClick=${() => setOpen(open === c.seq ? null : c.seq)} class="click">
        <td>${c.seq}</td><td class="mono small">${c.key}</td><td class="mono">${c.cmd || (c.argv || []).join(" ")}</td>
        <td><${Badge} kind=${c.state}>${c.state}<//></td><td>${c.result ? c.result.exit_code : "–"}</td>
        <td>${c.finished_at ? fmt.dur(c.finished_at - c.started_at) : "–"}</td><td>${fmt.ago(c.started_at)}</td></tr>
        ${open === c.seq && c.result ? html`<tr><td colspan="7"><pre class="file">${c.result.stdout}${c.result.stderr ? `\n--- stderr ---\n${c.result.stderr}` : ""}</pre></td></tr>` : null}`)}
      </tbody></table><//>`;
}

function Events({ id }) {
  const { data, error } = usePoll(() => api(`/v1/sandboxes/${id}/events`), 3000, [id]);
  return html`<${ErrorNote} error=${error} /><${Card} title="Events">
    <table class="t"><thead><tr><th>when</th><th>kind</th><th>message</th></tr></thead>
      <tbody>${(data || []).slice().reverse().map((e) => html`<tr><td title=${fmt.time(e.t)}>${fmt.ago(e.t)}</td>
        <td><${Badge} kind=${e.kind}>${e.kind}<//></td><td>${e.message}</td></tr>`)}</tbody></table><//>`;
}

function Audit({ id }) {
  const [flagged, setFlagged] = useState(false);
  const { data, error } = usePoll(() => api(`/v1/sandboxes/${id}/audit${qs({ flagged, limit: 500 })}`), 3000, [id, flagged]);
  const flags = (data || []).filter((r) => r.flag).length;
  return html`<${ErrorNote} error=${error} /><${Card} title="Audit log"
    right=${html`<label><input type="checkbox" checked=${flagged} onChange=${(e) => setFlagged(e.target.checked)} /> flags only</label>`}>
    ${flags ? html`<p class="error">${flags} flagged record${flags > 1 ? "s" : ""}</p>` : null}
    <table class="t"><thead><tr><th>when</th><th>kind</th><th>flag</th><th>detail</th></tr></thead>
      <tbody>${(data || []).slice().reverse().map((r) => html`<tr class=${r.flag ? "flagged" : ""}><td>${fmt.ago(r.ts)}</td>
        <td>${r.kind}</td><td>${r.flag ? html`<${Badge} kind="failed">${r.flag}<//>` : ""}</td><td class="mono small">${r.detail}</td></tr>`)}
      </tbody></table><//>`;
}

function Screen({ id }) {
  const [keys, setKeys] = useState("");
  const [err, setErr] = useState(null);
  const img = useRef(null);
  const { error } = usePoll(async () => {
    const r = await api(`/v1/sandboxes/${id}/screenshot`, { raw: true });
    const url = URL.createObjectURL(await r.blob());
    if (img.current) {
      const old = img.current.src;
      img.current.src = url;
      if (old.startsWith("blob:")) URL.revokeObjectURL(old);
    }
    return true;
  }, 2000, [id]);
  const send = async (e) => {
    e.preventDefault();
    try { await api(`/v1/sandboxes/${id}/keys`, { method: "POST", body: { keys } }); setKeys(""); setErr(null); } catch (x) { setErr(x); }
  };
  return html`<${Card} title="Screen">
    <${ErrorNote} error=${error} />
    <img class="screen" alt="the VM's screen" ref=${img} data-testid="screen" />
    <form class="filters" onSubmit=${send}><input name="keys" placeholder="keys, e.g. 'h i ret' or 'ctrl-alt-t'" value=${keys}
      onInput=${(e) => setKeys(e.target.value)} /><button type="submit">Send keys</button></form>
    <${ErrorNote} error=${err} /><//>`;
}
