// The dashboard's only script: the time-window selector, and the tap page's live table, read
// from /api/tap (a JSON object a line) with fetch and a stream reader. Every value shown is set
// as text (textContent), never as HTML: a path or a pod name is whatever a client sent.
"use strict";

const MAX_TAP_ROWS = 100; // rows the live table keeps; the oldest go first

function keepWindow() {
  const select = document.getElementById("window");
  if (!select) return;
  select.addEventListener("change", () => {
    const url = new URL(window.location.href);
    url.searchParams.set("window", select.value);
    window.location.assign(url.toString());
  });
}

function cell(row, text) {
  const td = document.createElement("td");
  td.textContent = text === undefined || text === null || text === "" ? "-" : String(text);
  row.appendChild(td);
  return td;
}

function startTap() {
  const form = document.getElementById("tap-form");
  if (!form) return;
  const status = document.getElementById("tap-status");
  const stop = document.getElementById("tap-stop");
  const start = document.getElementById("tap-start");
  const body = document.querySelector("#tap-events tbody");
  let controller = null;
  let failed = false; // a proxy's stream failed: its error stays on show when the tap ends
  const requests = new Map(); // stream id → its row, until its response arrives

  function say(text, kind) {
    status.textContent = text;
    status.className = "notice " + (kind || "info");
  }

  function show(event) {
    if (event.type === "req") {
      const row = document.createElement("tr");
      row.className = "tap-row";
      row.dataset.id = event.id;
      cell(row, event.direction);
      cell(row, event.proxy);
      cell(row, event.method);
      cell(row, event.authority);
      cell(row, event.path).className = "tap-path";
      cell(row, "").className = "tap-status";
      cell(row, "").className = "tap-latency";
      cell(row, event.tls);
      cell(row, event.src);
      cell(row, event.dst);
      body.insertBefore(row, body.firstChild);
      requests.set(event.id, row);
      while (body.rows.length > MAX_TAP_ROWS) {
        const last = body.rows[body.rows.length - 1];
        requests.delete(last.dataset.id);
        last.remove();
      }
    } else if (event.type === "rsp") {
      const row = requests.get(event.id);
      if (row) {
        row.querySelector(".tap-status").textContent = String(event.status);
        row.querySelector(".tap-latency").textContent =
          (Number(event.latency) * 1000).toFixed(1) + " ms";
      }
    } else if (event.type === "end") {
      requests.delete(event.id);
    } else if (event.type === "error") {
      failed = true;
      say("error from " + (event.proxy || "the tap") + ": " + event.message, "error");
    } else if (event.type === "end_of_tap") {
      // the server's last line repeats the proxies' errors, in the tap controller's words
      say("Tap ended: " + event.message, failed ? "error" : "info");
    }
  }

  async function run(params) {
    controller = new AbortController();
    failed = false;
    start.disabled = true;
    stop.disabled = false;
    say("Tapping " + params.get("resource") + "…");
    try {
      const response = await fetch("/api/tap?" + params.toString(), { signal: controller.signal });
      if (!response.ok) {
        let message = "the dashboard answered " + response.status;
        try {
          message = (await response.json()).message || message;
        } catch (e) { /* not JSON: keep the status */ }
        say(message, "error");
        return;
      }
      say("Tapping " + params.get("resource") + ": live.");
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        const lines = buffer.split("\n");
        buffer = lines.pop();
        for (const line of lines) {
          if (line.trim()) show(JSON.parse(line));
        }
      }
    } catch (e) {
      if (e.name !== "AbortError") say("Tap failed: " + e.message, "error");
      else say("Stopped.");
    } finally {
      start.disabled = false;
      stop.disabled = true;
      controller = null;
    }
  }

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    if (controller) controller.abort();
    const params = new URLSearchParams();
    for (const [key, value] of new FormData(form)) {
      if (value) params.set(key, value);
    }
    history.replaceState(null, "", "/tap?" + params.toString());
    run(params);
  });
  stop.addEventListener("click", () => controller && controller.abort());
}

document.addEventListener("DOMContentLoaded", () => {
  keepWindow();
  startTap();
});
