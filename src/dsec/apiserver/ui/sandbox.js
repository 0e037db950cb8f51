// One sandbox's story, from /v1/sandboxes/{id} and /v1/audit?sandbox_id= (paged by seq).
"use strict";

(() => {
  const { el } = DSec;
  const id = decodeURIComponent(window.location.pathname.split("/").pop() || "");
  document.getElementById("sb-id").textContent = id;
  document.title = "DSec · " + id;
  const q = "sandbox_id=" + encodeURIComponent(id);
  const records = [];
  let since = 0;

  function summary(sb) {
    const dl = document.getElementById("summary");
    const items = [
      ["State", sb.state], ["Backend", sb.backend], ["Image", sb.image],
      ["Job", (sb.spec && sb.spec.job_id) || ""], ["Edge", sb.edge],
      ["Created", new Date(sb.created_at).toLocaleString() + " (" + DSec.age(sb.created_at) + " ago)"],
      ["Reason", sb.reason || ""],
      ["Labels", Object.entries(sb.labels || {}).map(([k, v]) => k + "=" + v).join(", ")],
    ];
    const rows = items.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]);
    if (sb.backend === "fullvm" && sb.state === "running") {  // a VM's screen: its live view
      const href = "/ui/desktop/" + encodeURIComponent(sb.id);
      rows.push(el("dt", {}, "Screen"), el("dd", {}, el("a", { id: "live-view", href }, "live view")));
    }
    dl.replaceChildren(...rows);
  }

  function commandText(c) {
    return Array.isArray(c) ? c.join(" ") : c === undefined || c === null ? "" : String(c);
  }

  function fmtDuration(d) {
    return typeof d === "number" ? (d < 1 ? (d * 1000).toFixed(1) + " ms" : d.toFixed(2) + " s") : "";
  }

  function render() {
    const timeline = [], commands = [], files = [], network = [], events = [];
    const started = {};
    for (const r of records) {
      const d = r.detail || {};
      if (r.kind === "command" && r.action === "process_start") started[d.process] = r;
    }
    for (const r of records) {
      const d = r.detail || {};
      const t = DSec.time(r.time);
      if (r.kind === "lifecycle") {
        const rest = Object.assign({}, d);
        timeline.push(el("li", {}, el("b", {}, r.action), " ", el("span", { class: "muted" }, t + " " + DSec.detail(rest))));
      } else if (r.kind === "command") {
        if (r.action === "process_start") continue;
        const cmd = r.action === "process_end" ? commandText((started[d.process] || { detail: {} }).detail.command) : commandText(d.command);
        const exit = d.timed_out ? "timed out" : d.exit_code !== undefined ? String(d.exit_code) : d.error ? "error: " + d.error : "";
        commands.push(el("tr", {},
          el("td", {}, t), el("td", { class: "mono" }, (r.action === "exec" || r.action === "process_end" ? "" : r.action + ": ") + cmd),
          el("td", { class: d.exit_code ? "bad" : "" }, exit), el("td", {}, fmtDuration(d.duration))));
      } else if (r.kind === "file") {
        files.push(el("tr", {}, el("td", {}, t), el("td", {}, r.action),
          el("td", { class: "mono" }, d.path === undefined ? DSec.detail(d) : String(d.path) + (d.path2 ? " -> " + d.path2 : ""))));
      } else if (r.kind === "network") {
        network.push(el("tr", {}, el("td", {}, t), el("td", {}, r.action), el("td", { class: "mono" }, DSec.detail(d))));
      } else if (r.kind === "event") {
        events.push(el("li", {}, el("span", { class: "kind" }, r.action), el("span", { class: "muted" }, t),
          el("span", { class: "detail" }, DSec.detail(d))));
      }
    }
    document.getElementById("timeline").replaceChildren(...timeline);
    document.querySelector("#commands tbody").replaceChildren(...commands);
    document.querySelector("#files tbody").replaceChildren(...files);
    document.querySelector("#network tbody").replaceChildren(...network);
    document.getElementById("events").replaceChildren(...events);
  }

  // Resource graphs: this sandbox's row of /v1/stats every second (only its cgroup is
  // read); CPU in cores is the change of its CPU time over the change of wall time.
  const N = 120;
  const memory = new DSec.Plot("plot-sb-memory", "v-sb-memory", ["value"], N, DSec.bytes);
  const cpu = new DSec.Plot("plot-sb-cpu", "v-sb-cpu", ["cpu"], N, (v) => v.toFixed(2));
  let last = null;
  DSec.every(1000, async () => {
    const rows = await DSec.json("/v1/stats?" + q);
    const row = rows.find((r) => r.id === id);
    if (!row) return; // not live (any more): the graphs keep what they have
    const t = performance.now() / 1000;
    memory.push("value", typeof row.memory_bytes === "number" ? row.memory_bytes : null);
    if (last !== null && typeof row.cpu_seconds === "number" && typeof last.cpu === "number") {
      cpu.push("cpu", Math.max(0, row.cpu_seconds - last.cpu) / Math.max(0.001, t - last.t));
    }
    last = { t, cpu: row.cpu_seconds };
    memory.draw();
    cpu.draw();
  });

  DSec.every(2000, async () => {
    const resp = await DSec.api("/v1/sandboxes/" + encodeURIComponent(id));
    if (resp.ok) summary(await resp.json());
    for (;;) {
      const page = await DSec.json("/v1/audit?" + q + "&limit=1000&since_seq=" + since);
      records.push(...page);
      if (page.length) since = page[page.length - 1].seq;
      if (page.length < 1000) break;
    }
    render();
  });
})();
