// The live view of one VM's screen: noVNC (vendored from the npm registry by
// scripts/install.sh, served from /ui/novnc/) connects to the edge's
// /v1/edge/sandboxes/<id>/desktop/vnc WebSocket with a view-only sandbox token (dsv1:
// it opens nothing but the live view) the page gets from
// POST /v1/sandboxes/<id>/view-token (the session cookie plus its CSRF header). What the VM
// sends is drawn into noVNC's canvas only; the status line is set with textContent.
import RFB from "/ui/novnc/core/rfb.js";

const id = decodeURIComponent(location.pathname.split("/").pop() || "");
const status = document.getElementById("status");
document.getElementById("sb-id").textContent = id;

function say(text) {
  status.textContent = text;
  document.body.dataset.vnc = text.split(":")[0];
}

async function token() {
  const session = await DSec.session();
  const resp = await DSec.api("/v1/sandboxes/" + encodeURIComponent(id) + "/view-token", {
    method: "POST",
    headers: { "X-DSec-CSRF": session.csrf },
  });
  if (!resp.ok) throw new Error("token: HTTP " + resp.status);
  return (await resp.json()).token;
}

async function connect() {
  const scheme = location.protocol === "https:" ? "wss://" : "ws://";
  const url = scheme + location.host + "/v1/edge/sandboxes/" + encodeURIComponent(id)
    + "/desktop/vnc?token=" + encodeURIComponent(await token());
  const rfb = new RFB(document.getElementById("screen"), url, { shared: true });
  rfb.scaleViewport = false;
  rfb.addEventListener("connect", () => say("connected: " + id));
  rfb.addEventListener("disconnect", (e) =>
    say(e.detail.clean ? "disconnected" : "disconnected: the connection was lost"));
  rfb.addEventListener("desktopname", (e) => { document.title = "DSec · " + e.detail.name; });
}

// A module runs once the document is parsed (and common.js, deferred before it, ran).
connect().catch((err) => say("error: " + err.message));
