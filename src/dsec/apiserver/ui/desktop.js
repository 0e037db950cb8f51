// The live view of one VM's screen: noVNC (vendored from the npm registry by
// scripts/install.sh, served from /ui/novnc/) connects to the edge's
// /v1/edge/sandboxes/<id>/desktop/vnc WebSocket with a view-only sandbox token (dsv1:
// it opens nothing but the live view) the page gets from
// POST /v1/sandboxes/<id>/view-token (the session cookie plus its CSRF header). What the VM
// sends is drawn into noVNC's canvas only; the status line is set with textContent.
//
// noVNC itself never gives up on a connection that opens and then says nothing, and a
// fetch has no deadline: a page could show "connecting…" for good. So each attempt has
// a deadline, the status line names the step it is at (token, connecting), and an
// attempt that fails before the view ever connected is tried again a few times, with
// the reason shown. Once connected, a disconnect is final (reload to view again).
import RFB from "/ui/novnc/core/rfb.js";

// One attempt: the RFB handshake with a running VM's VNC server takes milliseconds, a
// TCG guest's on a loaded host some seconds.
const ATTEMPT_MS = 15000;
const RETRY_WAITS_MS = [1000, 2000, 5000, 10000]; // before attempts 2..5

const id = decodeURIComponent(location.pathname.split("/").pop() || "");
const status = document.getElementById("status");
const screen = document.getElementById("screen");
document.getElementById("sb-id").textContent = id;
let attempt = 0;

// data-vnc is the word before the colon (token, connecting, retrying, connected,
// disconnected, error); data-attempts how many attempts were made (tests read both).
function say(text) {
  status.textContent = text;
  document.body.dataset.vnc = text.split(":")[0];
  document.body.dataset.attempts = String(attempt);
}

async function token() {
  const session = await DSec.session();
  const resp = await DSec.api("/v1/sandboxes/" + encodeURIComponent(id) + "/view-token", {
    method: "POST",
    headers: { "X-DSec-CSRF": session.csrf },
  });
  if (!resp.ok) throw new Error("the view token was refused (HTTP " + resp.status + ")");
  return (await resp.json()).token;
}

// A promise that fails with `what` after `ms` unless `promise` settles first.
function within(ms, promise, what) {
  let timer;
  const late = new Promise((_, reject) => { timer = setTimeout(() => reject(new Error(what)), ms); });
  return Promise.race([promise, late]).finally(() => clearTimeout(timer));
}

function again(why) {
  if (attempt > RETRY_WAITS_MS.length) {
    say("disconnected: " + why + "; reload the page to try again");
    return;
  }
  const wait = RETRY_WAITS_MS[attempt - 1];
  say("retrying: " + why + "; attempt " + (attempt + 1) + " in " + wait / 1000 + " s");
  setTimeout(start, wait);
}

async function connect() {
  attempt += 1;
  say("token: asking for a view token (attempt " + attempt + ")");
  let view;
  try {
    view = await within(ATTEMPT_MS, token(), "the view token request did not answer");
  } catch (err) {
    again(err.message);
    return;
  }
  const scheme = location.protocol === "https:" ? "wss://" : "ws://";
  const url = scheme + location.host + "/v1/edge/sandboxes/" + encodeURIComponent(id)
    + "/desktop/vnc?token=" + encodeURIComponent(view);
  say("connecting: to the VM's display (attempt " + attempt + ")");
  screen.replaceChildren(); // what an earlier attempt left
  const rfb = new RFB(screen, url, { shared: true });
  rfb.scaleViewport = false;
  let settled = false; // connected, or this attempt is over
  const deadline = setTimeout(() => {
    settled = true;
    rfb.disconnect();
    again("the VM's display did not answer within " + ATTEMPT_MS / 1000 + " s");
  }, ATTEMPT_MS);
  rfb.addEventListener("connect", () => {
    clearTimeout(deadline);
    settled = true;
    say("connected: " + id);
  });
  rfb.addEventListener("disconnect", (e) => {
    clearTimeout(deadline);
    if (!settled) { // the attempt failed before it connected
      settled = true;
      again("the connection was refused or lost");
    } else if (status.textContent.startsWith("connected")) {
      say(e.detail.clean ? "disconnected" : "disconnected: the connection was lost");
    }
  });
  rfb.addEventListener("desktopname", (e) => { document.title = "DSec · " + e.detail.name; });
}

function start() {
  connect().catch((err) => say("error: " + err.message));
}

// A module runs once the document is parsed (and common.js, deferred before it, ran).
start();
