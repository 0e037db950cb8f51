// The misbehaviour feed: /v1/events/stream?kind=event (server-sent events, resumable).
"use strict";

(() => {
  const { el } = DSec;
  const feed = document.getElementById("feed");
  const state = document.getElementById("feed-state");
  const MAX = 500;
  // EventSource reconnects by itself and sends Last-Event-ID, so nothing is lost or repeated.
  const source = new EventSource("/v1/events/stream?kind=event", { withCredentials: true });
  source.addEventListener("open", () => { state.textContent = "(live)"; });
  source.addEventListener("error", () => { state.textContent = "(reconnecting…)"; });
  source.addEventListener("event", (msg) => {
    let r;
    try { r = JSON.parse(msg.data); } catch (e) { return; }
    const d = r.detail || {};
    const item = el("li", { "data-seq": r.seq },
      el("span", { class: "kind" }, r.action),
      el("span", {}, DSec.time(r.time) + " "),
      el("a", { href: "/ui/sandbox/" + encodeURIComponent(r.sandbox_id) }, r.sandbox_id),
      r.job_id ? el("span", { class: "muted" }, " job " + r.job_id) : null,
      el("span", { class: "detail" }, DSec.detail(d)));
    feed.prepend(item);
    while (feed.childElementCount > MAX) feed.lastElementChild.remove();
  });
})();
