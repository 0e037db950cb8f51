// Shared helpers of the dashboard pages. Every value from the API is untrusted text:
// it only ever reaches the page through textContent / setAttribute, never as markup.
"use strict";

const DSec = {
  // el("td", {class: "x"}, "text", childNode, ...): a new element; strings become text.
  el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v !== undefined && v !== null) node.setAttribute(k, String(v));
    }
    for (const c of children) {
      if (c === undefined || c === null) continue;
      node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return node;
  },

  async api(path, init) {
    const resp = await fetch(path, Object.assign({ credentials: "same-origin" }, init || {}));
    if (resp.status === 401) {
      window.location.assign("/ui/login");
      throw new Error("session ended");
    }
    return resp;
  },

  async json(path) {
    const resp = await DSec.api(path);
    if (!resp.ok) throw new Error(path + ": HTTP " + resp.status);
    return resp.json();
  },

  // /ui/session: the CSRF secret and what this server lets the pages do (job_control).
  _session: null,
  async session() {
    if (DSec._session === null) DSec._session = await DSec.json("/ui/session");
    return DSec._session;
  },

  async csrf() {
    return (await DSec.session()).csrf;
  },

  async post(path) {
    return DSec.api(path, { method: "POST", headers: { "X-DSec-CSRF": await DSec.csrf() } });
  },

  // Repeat fn every `ms`, never overlapping, showing errors in #status.
  every(ms, fn) {
    const status = document.getElementById("status");
    const tick = async () => {
      try {
        await fn();
        if (status) status.textContent = "updated " + new Date().toLocaleTimeString();
      } catch (e) {
        if (status) status.textContent = "error: " + e.message;
      }
      setTimeout(tick, ms);
    };
    tick();
  },

  age(iso) {
    const s = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
    if (s < 60) return s.toFixed(0) + "s";
    if (s < 3600) return (s / 60).toFixed(0) + "m";
    if (s < 86400) return (s / 3600).toFixed(1) + "h";
    return (s / 86400).toFixed(1) + "d";
  },

  time(iso) {
    const d = new Date(iso);
    return isNaN(d) ? String(iso) : d.toLocaleTimeString();
  },

  bytes(n) {
    if (typeof n !== "number") return "";
    const u = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
    return n.toFixed(i ? 1 : 0) + " " + u[i];
  },

  // A compact one-line rendering of a record's detail (still only text).
  detail(obj) {
    try { return JSON.stringify(obj); } catch (e) { return String(obj); }
  },

  replaceRows(tbody, rows) {
    tbody.replaceChildren(...rows);
  },

  // The live plots of every page: an <svg class="plot" viewBox="0 0 600 160"> with one
  // <polyline> per line, the newest of `n` samples at the right edge, all lines scaled
  // to the largest value shown. A null sample is a gap in the data: the line skips it.
  // The first line's newest value and the largest value go into data-* attributes
  // (what the browser tests read) and, formatted, into the caption element `valueId`.
  // `na = true`: the server has no such series (none counted here): the caption says
  // "n/a" (and data-na="true"), not a value and not "-" (a sample not taken yet).
  Plot: class {
    constructor(svgId, valueId, lines, n, fmt) {
      this.svg = document.getElementById(svgId);
      this.value = document.getElementById(valueId);
      this.lines = lines;
      this.n = n;
      this.fmt = fmt;
      this.samples = Object.fromEntries(lines.map((name) => [name, []]));
      this.na = false;
      for (const name of lines) {
        if (!this.svg.querySelector("polyline." + name)) {
          const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
          line.setAttribute("class", name);
          line.setAttribute("points", "");
          this.svg.append(line);
        }
      }
    }

    push(name, v) {
      const s = this.samples[name];
      s.push(v);
      if (s.length > this.n) s.shift();
    }

    draw() {
      const all = this.lines.flatMap((name) => this.samples[name]).filter((v) => v !== null);
      const max = Math.max(1e-9, ...all);
      for (const name of this.lines) {
        const pts = [];
        this.samples[name].forEach((v, i) => {
          if (v !== null) pts.push((i * 600 / (this.n - 1)).toFixed(1) + "," + (155 - v / max * 145).toFixed(1));
        });
        this.svg.querySelector("polyline." + name).setAttribute("points", pts.join(" "));
      }
      const first = this.samples[this.lines[0]];
      const last = first.length ? first[first.length - 1] : null;
      this.svg.setAttribute("data-samples", String(first.length));
      this.svg.setAttribute("data-last", last === null ? "" : String(last));
      this.svg.setAttribute("data-max", all.length ? String(Math.max(...all)) : "");
      const newest = this.lines.map((name) => {
        const s = this.samples[name];
        return s.length ? s[s.length - 1] : null;
      });
      this.svg.setAttribute("data-na", String(this.na));
      if (this.value) {
        this.value.textContent = this.na ? "n/a" : newest.every((v) => v === null) ? "-" : this.fmt(...newest);
      }
    }
  },
};
