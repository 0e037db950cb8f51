// Live plots drawn as SVG polylines: samples of /metrics and /v1/sandboxes every second.
"use strict";

(() => {
  const N = 120; // two minutes of one-second samples
  const series = { concurrent: [], creates: [], commands: [], memory: [] };
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

  function draw(name, values, fmt) {
    const svg = document.getElementById("plot-" + name);
    const max = Math.max(1, ...values);
    const pts = values.map((v, i) => (i * 600 / (N - 1)).toFixed(1) + "," + (155 - v / max * 145).toFixed(1));
    svg.querySelector("polyline").setAttribute("points", pts.join(" "));
    svg.setAttribute("data-samples", String(values.length));
    svg.setAttribute("data-last", values.length ? String(values[values.length - 1]) : "");
    document.getElementById("v-" + name).textContent = values.length ? fmt(values[values.length - 1]) : "-";
  }

  function push(name, v) {
    const s = series[name];
    s.push(v);
    if (s.length > N) s.shift();
  }

  DSec.every(1000, async () => {
    const [text, list] = await Promise.all([
      DSec.api("/metrics").then((r) => r.text()),
      DSec.json("/v1/sandboxes"),
    ]);
    const now = performance.now() / 1000;
    const creates = metric(text, "dsec_sandbox_creates_total", 'outcome="ok"') || 0;
    const commands = metric(text, "dsec_commands_total") || 0;
    push("concurrent", list.filter((s) => s.state !== "stopped" && s.state !== "failed").length);
    if (prev !== null) {
      const dt = Math.max(0.001, now - prev.t);
      push("creates", Math.max(0, creates - prev.creates) / dt);
      push("commands", Math.max(0, commands - prev.commands) / dt);
    }
    const mem = metric(text, "dsec_host_memory_available_bytes");
    if (mem !== null) push("memory", mem);
    prev = { t: now, creates, commands };
    draw("concurrent", series.concurrent, (v) => String(v));
    draw("creates", series.creates, (v) => v.toFixed(2));
    draw("commands", series.commands, (v) => v.toFixed(2));
    draw("memory", series.memory, DSec.bytes);
  });
})();
