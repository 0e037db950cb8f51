// The live sandbox table: /v1/sandboxes polled every second, filtered in the page.
"use strict";

(() => {
  const { el } = DSec;
  const tbody = document.querySelector("#sandboxes tbody");
  const fState = document.getElementById("f-state");
  const fBackend = document.getElementById("f-backend");
  const fJob = document.getElementById("f-job");
  const count = document.getElementById("count");
  const seen = { state: new Set(), backend: new Set() };
  let statsAvailable = true; // GET /v1/stats (per live sandbox); off after a 404
  let last = [];
  let stats = {};

  function addOption(select, kind, value) {
    if (!value || seen[kind].has(value)) return;
    seen[kind].add(value);
    select.append(el("option", { value }, value));
  }

  function indexStats(body) {
    const out = {};
    const rows = Array.isArray(body) ? body : Array.isArray(body && body.sandboxes) ? body.sandboxes : null;
    if (rows) {
      for (const r of rows) out[r.sandbox_id || r.id] = r;
    } else if (body && typeof body === "object") {
      Object.assign(out, body);
    }
    return out;
  }

  async function loadStats() {
    if (!statsAvailable) return;
    const resp = await DSec.api("/v1/stats");
    if (resp.status === 404) { statsAvailable = false; return; }
    if (resp.ok) stats = indexStats(await resp.json());
  }

  function render() {
    const want = { state: fState.value, backend: fBackend.value, job: fJob.value.trim() };
    const rows = [];
    for (const sb of last) {
      const job = (sb.spec && sb.spec.job_id) || "";
      if (want.state && sb.state !== want.state) continue;
      if (want.backend && sb.backend !== want.backend) continue;
      if (want.job && !job.includes(want.job)) continue;
      const labels = el("td");
      for (const [k, v] of Object.entries(sb.labels || {})) {
        labels.append(el("span", { class: "label" }, k + "=" + v));
      }
      const st = stats[sb.id] || {};
      rows.push(el("tr", { "data-id": sb.id },
        el("td", { class: "mono" }, el("a", { href: "/ui/sandbox/" + encodeURIComponent(sb.id) }, sb.id)),
        el("td", {}, el("span", { class: "state state-" + sb.state }, sb.state)),
        el("td", {}, sb.backend),
        el("td", { class: "mono" }, sb.image),
        el("td", { class: "mono" }, job),
        labels,
        el("td", {}, DSec.age(sb.created_at)),
        el("td", { class: "stat" }, typeof st.cpu_seconds === "number" ? st.cpu_seconds.toFixed(2) : ""),
        el("td", { class: "stat" }, DSec.bytes(st.memory_bytes)),
        el("td", { class: "stat" }, typeof st.idle_seconds === "number" ? st.idle_seconds.toFixed(0) + "s" : ""),
      ));
    }
    DSec.replaceRows(tbody, rows);
    count.textContent = "(" + rows.length + " shown of " + last.length + ")";
  }

  for (const f of [fState, fBackend, fJob]) f.addEventListener("input", render);

  DSec.every(1000, async () => {
    last = await DSec.json("/v1/sandboxes");
    last.sort((a, b) => Date.parse(b.created_at) - Date.parse(a.created_at));
    for (const sb of last) { addOption(fState, "state", sb.state); addOption(fBackend, "backend", sb.backend); }
    try { await loadStats(); } catch (e) { /* optional */ }
    render();
  });
})();
