// Live plots (DSec.Plot): samples of /metrics and /v1/sandboxes every second. Latency
// percentiles come from the histograms' buckets: the difference between the newest
// scrape and the one WINDOW seconds before is what ended in that window, and its p50
// and p99 are estimated inside a bucket as Prometheus's histogram_quantile does.
"use strict";

(() => {
  const N = 120; // two minutes of one-second samples
  const WINDOW = 10; // seconds of histogram deltas behind each latency sample
  const ms = (v) => (v === null ? "-" : v < 1 ? (v * 1000).toFixed(1) + " ms" : v.toFixed(2) + " s");
  const pair = (p50, p99) => "p50 " + ms(p50) + " · p99 " + ms(p99);
  const plots = {
    concurrent: new DSec.Plot("plot-concurrent", "v-concurrent", ["value"], N, (v) => String(v)),
    creates: new DSec.Plot("plot-creates", "v-creates", ["value"], N, (v) => v.toFixed(2)),
    commands: new DSec.Plot("plot-commands", "v-commands", ["value"], N, (v) => v.toFixed(2)),
    memory: new DSec.Plot("plot-memory", "v-memory", ["value"], N, DSec.bytes),
    createLatency: new DSec.Plot("plot-create-latency", "v-create-latency", ["p50", "p99"], N, pair),
    commandLatency: new DSec.Plot("plot-command-latency", "v-command-latency", ["p50", "p99"], N, pair),
  };
  const history = []; // the last WINDOW+1 scrapes' latency buckets
  let prev = null;

  // Sum of a metric's samples in Prometheus text, optionally only those with a label value.
  function metric(text, name, label) {
    let sum = 0, found = false;
    for (const line of text.split("\n")) {
      if (!line.startsWith(name)) continue;
      const rest = line.slice(name.length);
      if (rest[0] !== " " && rest[0] !== "{") continue;
      if (label && !rest.includes(label)) continue;
      const v = parseFloat(line.slice(line.lastIndexOf(" ") + 1));
      if (!isNaN(v)) { sum += v; found = true; }
    }
    return found ? sum : null;
  }

  // The cumulative buckets of histograms `names` (summed over every label set, e.g.
  // backends), as a Map from the upper bound `le` (Infinity for +Inf) to a count.
  function buckets(text, names) {
    const out = new Map();
    for (const line of text.split("\n")) {
      if (!names.some((n) => line.startsWith(n + "_bucket{"))) continue;
      const m = /le="([^"]+)"\}\s+(\S+)$/.exec(line);
      if (!m) continue;
      const le = m[1] === "+Inf" ? Infinity : parseFloat(m[1]);
      const v = parseFloat(m[2]);
      if (!isNaN(le) && !isNaN(v)) out.set(le, (out.get(le) || 0) + v);
    }
    return out;
  }

  // The q-quantile of what the buckets gained from `old` to `now`; null if nothing.
  function quantile(q, old, now) {
    const les = [...now.keys()].sort((a, b) => a - b);
    const counts = les.map((le) => Math.max(0, now.get(le) - (old.get(le) || 0)));
    const total = counts.length ? counts[counts.length - 1] : 0;
    if (total <= 0) return null;
    const rank = q * total;
    for (let i = 0; i < les.length; i++) {
      if (counts[i] >= rank) {
        if (les[i] === Infinity) return i > 0 ? les[i - 1] : null;
        const lower = i > 0 ? les[i - 1] : 0, below = i > 0 ? counts[i - 1] : 0;
        const inside = counts[i] - below;
        return inside > 0 ? lower + (les[i] - lower) * (rank - below) / inside : les[i];
      }
    }
    return null;
  }

  function latency(plot, key) {
    const now = history[history.length - 1][key], old = history[0][key];
    plot.na = now.size === 0; // no bucket at all: this server observes none
    plot.push("p50", quantile(0.5, old, now));
    plot.push("p99", quantile(0.99, old, now));
  }

  // A rate of a counter; null (and the plot n/a) while the server has no sample of it:
  // metrics off, or a series this server does not count (a cluster apiserver counts the
  // creates it placed; commands are counted by each edge).
  function rate(plot, name, now, dt) {
    const was = prev === null ? null : prev[name];
    plot.na = now === null;
    if (dt !== null) plot.push("value", now === null || was === null ? null : Math.max(0, now - was) / dt);
  }

  let clusterNoted = false;
  async function noteCluster() {
    if (clusterNoted) return;
    clusterNoted = true;
    const health = await DSec.json("/v1/health");
    document.getElementById("cluster-note").hidden = health.edge !== "cluster";
  }

  DSec.every(1000, async () => {
    const [text, list] = await Promise.all([
      // a 404: the operator turned metrics off (DSEC_METRICS=0); the rest still plots
      DSec.api("/metrics").then((r) => (r.ok ? r.text() : "")),
      DSec.json("/v1/sandboxes"),
    ]);
    document.getElementById("metrics-off").hidden = text !== "";
    await noteCluster();
    const now = performance.now() / 1000;
    const creates = metric(text, "dsec_sandbox_creates_total", 'outcome="ok"');
    const commands = metric(text, "dsec_commands_total");
    plots.concurrent.push("value", list.filter((s) => s.state !== "stopped" && s.state !== "failed").length);
    const dt = prev === null ? null : Math.max(0.001, now - prev.t);
    rate(plots.creates, "creates", creates, dt);
    rate(plots.commands, "commands", commands, dt);
    const mem = metric(text, "dsec_host_memory_available_bytes");
    plots.memory.na = mem === null;
    plots.memory.push("value", mem);
    prev = { t: now, creates, commands };
    history.push({
      create: buckets(text, ["dsec_sandbox_create_seconds"]),
      // a command's latency: the control route's round trip, the data path's run time
      command: buckets(text, ["dsec_exec_seconds", "dsec_command_seconds"]),
    });
    if (history.length > WINDOW + 1) history.shift();
    if (history.length > 1) {
      latency(plots.createLatency, "create");
      latency(plots.commandLatency, "command");
    }
    for (const plot of Object.values(plots)) plot.draw();
  });
})();
