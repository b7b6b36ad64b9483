// The job page, live: log lines, state changes and meter ticks over a websocket.
// Every event carries the job's sequence number; on reconnect we ask for what came after the
// last one we showed, so nothing is lost and nothing shown twice.
(function () {
  "use strict";
  const script = document.getElementById("job-script");
  const jobId = script.dataset.job;
  const currency = script.dataset.currency;
  let lastSeq = parseInt(script.dataset.after, 10) || 0;
  let retry = 500;
  const log = document.getElementById("log");
  const TERMINAL = ["succeeded", "failed", "stopped", "cancelled"];

  function pad(n) { return String(n).padStart(2, "0"); }
  function duration(s) { return Math.floor(s / 3600) + ":" + pad(Math.floor(s / 60) % 60) + ":" + pad(s % 60); }
  function money(amount, places, most) {
    return currency + " " + Number(amount).toLocaleString("en-US", { minimumFractionDigits: places, maximumFractionDigits: most || places });
  }

  function atBottom() { return log.scrollHeight - log.scrollTop - log.clientHeight < 40; }

  function addLine(text, cls, seq) {
    const span = document.createElement("span");
    span.className = "line " + cls;
    span.dataset.seq = seq;
    span.textContent = text + "\n";
    log.appendChild(span);
  }

  function setState(state, reason, at) {
    const badge = document.getElementById("job-state");
    badge.className = "state state-" + state;
    badge.textContent = state.charAt(0).toUpperCase() + state.slice(1);
    const li = document.createElement("li");
    const tag = document.createElement("span");
    tag.className = "state state-" + state;
    tag.textContent = state;
    const time = document.createElement("time");
    time.className = "small mono";
    time.dateTime = at;
    time.textContent = new Date(at).toISOString().substring(11, 19);
    const why = document.createElement("div");
    why.className = "muted small";
    why.textContent = reason || "";
    li.append(tag, " ", time, why);
    document.getElementById("timeline").appendChild(li);
    if (TERMINAL.includes(state)) {
      const cancel = document.getElementById("cancel-form");
      if (cancel) cancel.remove();
      const wait = document.getElementById("wait-reason");
      if (wait) wait.remove();
      document.body.dispatchEvent(new Event("job-ended"));
    }
  }

  function setMeter(e) {
    document.getElementById("meter-held").textContent = duration(e.held_seconds);
    document.getElementById("meter-amount").textContent = money(e.amount, 4);
    document.getElementById("meter").dataset.running = e.running ? "1" : "0";
    document.getElementById("meter-note").textContent = e.running
      ? "Running: " + e.gpus + " device" + (e.gpus === 1 ? "" : "s") + " at " + money(e.rate, 2, 4) + " per GPU-hour."
      : "Stopped: compute released.";
  }

  function size(bytes) {
    const units = ["bytes", "KB", "MB", "GB", "TB"];
    let n = bytes, i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return (i === 0 ? n : n.toFixed(1)) + " " + units[i];
  }

  function setStaging(e) {
    const card = document.getElementById("staging");
    card.hidden = false;
    const state = document.getElementById("staging-state");
    state.className = "state state-" + e.state;
    state.textContent = e.state;
    document.getElementById("staging-node").textContent = "on " + e.node;
    document.getElementById("staging-bar").value = e.bytes_total ? Math.floor(100 * e.bytes_done / e.bytes_total) : (e.state === "staged" ? 100 : 0);
    let detail = e.files_done + " of " + e.files_total + " files · " + size(e.bytes_done) + " of " + size(e.bytes_total) +
      " · " + size(e.bytes_moved) + " moved, the rest from the node's cache";
    if (e.seconds !== null && e.seconds !== undefined) detail += " · " + e.seconds.toFixed(1) + " s";
    if (e.throughput) detail += " · " + size(e.throughput) + "/s";
    document.getElementById("staging-detail").textContent = detail;
    document.getElementById("staging-error").textContent = e.error || "";
  }

  function handle(events) {
    const follow = atBottom();
    for (const e of events) {
      if (e.seq <= lastSeq) continue;
      lastSeq = e.seq;
      if (e.kind === "log") addLine(e.text, e.stream, e.seq);
      else if (e.kind === "state") setState(e.state, e.reason, e.at);
      else if (e.kind === "meter") setMeter(e);
      else if (e.kind === "staging") setStaging(e);
      else if (e.kind === "notice") addLine("[e31] " + e.text, "sys", e.seq);
    }
    if (follow) log.scrollTop = log.scrollHeight;
  }

  function connect() {
    const scheme = location.protocol === "https:" ? "wss://" : "ws://";
    const socket = new WebSocket(scheme + location.host + "/ws/jobs/" + jobId + "/?after=" + lastSeq);
    socket.onopen = function () { retry = 500; document.body.dataset.live = "1"; };
    socket.onmessage = function (message) {
      const data = JSON.parse(message.data);
      if (data.type === "events") handle(data.events);
    };
    socket.onclose = function (event) {
      document.body.dataset.live = "0";
      if (event.code === 4404) return;
      setTimeout(connect, retry);
      retry = Math.min(retry * 2, 10000);
    };
  }
  log.scrollTop = log.scrollHeight;
  connect();
})();
