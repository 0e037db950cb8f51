// RL jobs (sandboxes grouped by spec.job_id) with pause/resume (POST + CSRF header).
"use strict";

(() => {
  const { el } = DSec;
  const tbody = document.querySelector("#jobs tbody");
  const results = {};

  // The report's counts and totals (its per-sandbox list is on each sandbox's page).
  function summary(body) {
    return Object.entries(body || {})
      .filter(([k, v]) => k !== "job_id" && (typeof v === "number" || typeof v === "boolean"))
      .map(([k, v]) => k + "=" + (typeof v === "number" && !Number.isInteger(v) ? v.toFixed(3) : v))
      .join(" ");
  }

  async function act(job, verb) {
    results[job] = verb + "…";
    try {
      const resp = await DSec.post("/v1/jobs/" + encodeURIComponent(job) + "/" + verb);
      const body = await resp.json();
      results[job] = resp.ok ? verb + ": " + summary(body) : "error: " + ((body.error && body.error.message) || resp.status);
    } catch (e) {
      results[job] = "error: " + e.message;
    }
  }

  // A server without job pause/resume: no buttons (never a button that cannot work).
  let control = null;

  DSec.every(1000, async () => {
    if (control === null) {
      control = (await DSec.session()).job_control === true;
      document.getElementById("no-job-control").hidden = control;
    }
    const list = await DSec.json("/v1/sandboxes");
    const jobs = new Map();
    for (const sb of list) {
      const job = sb.spec && sb.spec.job_id;
      if (!job) continue;
      if (!jobs.has(job)) jobs.set(job, {});
      const c = jobs.get(job);
      c[sb.state] = (c[sb.state] || 0) + 1;
    }
    const rows = [];
    for (const [job, states] of [...jobs.entries()].sort()) {
      const total = Object.values(states).reduce((a, b) => a + b, 0);
      const pause = el("button", { type: "button", class: "pause" }, "Pause");
      const resume = el("button", { type: "button", class: "resume" }, "Resume");
      pause.addEventListener("click", () => act(job, "pause"));
      resume.addEventListener("click", () => act(job, "resume"));
      rows.push(el("tr", { "data-job": job },
        el("td", { class: "mono" }, job), el("td", {}, total),
        el("td", {}, Object.entries(states).map(([s, n]) => s + ": " + n).join(", ")),
        el("td", {}, ...(control ? [pause, " ", resume] : ["-"])),
        el("td", { class: "mono result" }, results[job] || "")));
    }
    tbody.replaceChildren(...rows);
  });
})();
