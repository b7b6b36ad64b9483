// The job page, live: log lines, state changes, meter ticks, metric points and checkpoints
// over a websocket.
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

  // A run under torchrun: each line carries its process's rank; the filter shows one rank.
  const rankFilter = document.getElementById("rank-filter");
  function showRank(span) {
    const wanted = rankFilter ? rankFilter.value : "";
    span.hidden = wanted !== "" && span.dataset.rank !== wanted;
  }
  if (rankFilter) {
    rankFilter.addEventListener("change", function () {
      log.querySelectorAll(".line").forEach(showRank);
    });
  }
  function addLine(text, cls, seq, rank) {
    const span = document.createElement("span");
    span.className = "line " + cls;
    span.dataset.seq = seq;
    if (rank !== undefined && rank !== null) {
      span.dataset.rank = rank;
      const mark = document.createElement("span");
      mark.className = "rank";
      mark.textContent = "[" + rank + "]";
      span.append(mark, " ");
      if (rankFilter && !rankFilter.querySelector('option[value="' + rank + '"]')) {
        rankFilter.append(new Option(String(rank), String(rank)));
        document.getElementById("rank-filter-label").hidden = false;
      }
    }
    span.append(text + "\n");
    showRank(span);
    log.appendChild(span);
  }

  // One entry of the timeline: a state change, a checkpoint kept or a resume.
  function addTimeline(tagClass, label, text, at, liClass) {
    const li = document.createElement("li");
    if (liClass) li.className = liClass;
    const tag = document.createElement("span");
    tag.className = tagClass;
    tag.textContent = label;
    const time = document.createElement("time");
    time.className = "small mono";
    time.dateTime = at;
    time.textContent = new Date(at).toISOString().substring(11, 19);
    const why = document.createElement("div");
    why.className = "muted small";
    why.textContent = text || "";
    li.append(tag, " ", time, why);
    const timeline = document.getElementById("timeline");
    const follow = timeline.scrollHeight - timeline.scrollTop - timeline.clientHeight < 20;
    timeline.appendChild(li);
    if (follow) timeline.scrollTop = timeline.scrollHeight;
  }

  function setState(state, reason, at, from) {
    const badge = document.getElementById("job-state");
    badge.className = "state state-" + state;
    badge.textContent = state.charAt(0).toUpperCase() + state.slice(1);
    addTimeline("state state-" + state, state, reason, at);
    const restarts = document.getElementById("job-restarts");
    if (state === "queued" && from && restarts) restarts.textContent = (parseInt(restarts.textContent, 10) || 0) + 1;
    if (TERMINAL.includes(state)) {
      const cancel = document.getElementById("cancel-form");
      if (cancel) cancel.remove();
      const wait = document.getElementById("wait-reason");
      if (wait) wait.remove();
      const idle = document.getElementById("idle-notice");
      if (idle) idle.remove();  // an ended job holds nothing: no longer idle
      const costLabel = document.getElementById("metrics-cost-label");
      if (costLabel) costLabel.textContent = "final cost";
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
    // The metrics' header: what the job costs, its credit taken off, as the meter ticks.
    const cost = document.getElementById("metrics-cost-amount");
    if (cost) cost.textContent = money(Number(e.amount) - Number(e.credit_amount || 0), 4);
    const credit = document.getElementById("meter-credit");
    if (credit && e.credit_seconds > 0) {
      document.getElementById("credit-held").textContent = duration(e.credit_seconds);
      document.getElementById("credit-amount").textContent = money(e.credit_amount, 4);
      credit.hidden = false;
    }
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
      if (e.kind === "log") addLine(e.text, e.stream, e.seq, e.rank);
      else if (e.kind === "metric") addMetric(e);
      else if (e.kind === "state") setState(e.state, e.reason, e.at, e.from);
      else if (e.kind === "meter") setMeter(e);
      else if (e.kind === "staging") setStaging(e);
      else if (e.kind === "notice") addLine("[e31] " + e.text, "sys", e.seq);
      else if (e.kind === "checkpoint") { addTimeline("mark mark-checkpoint", "checkpoint", e.text, e.at, "tl-checkpoint"); addCheckpoint(e); }
      else if (e.kind === "resume") addTimeline("mark mark-resume", "resumed", e.text, e.at, "tl-resume");
    }
    if (follow) log.scrollTop = log.scrollHeight;
  }

  // Checkpoints: a kept one is listed at once (the newest first) and the card is fetched again
  // a moment later (htmx, on "checkpoint-kept") for what the server knows: sizes, pruned ones.
  function addCheckpoint(e) {
    const card = document.getElementById("checkpoints");
    const rows = document.getElementById("checkpoint-rows");
    if (!card || !rows) return;
    const keep = parseInt(card.dataset.keep, 10) || 0;
    // The card fetched again may have come back after the checkpoint was kept and before its
    // event reached this page: the server's row is already here, and stays the only one.
    if ([...rows.children].some((row) => row.dataset.name === e.name)) return;
    const li = document.createElement("li");
    li.dataset.name = e.name;
    const name = document.createElement("div");
    name.className = "name mono small";
    const link = document.createElement("a");
    link.href = card.dataset.url.replace("__name__", encodeURIComponent(e.name));
    link.setAttribute("download", "");
    link.textContent = e.name;
    name.append(link);
    const about = document.createElement("div");
    about.className = "muted small";
    const time = document.createElement("time");
    time.dateTime = e.at;
    time.textContent = new Date(e.at).toISOString().substring(0, 19).replace("T", " ");
    const step = e.step === null || e.step === undefined ? "" : "step " + e.step + " · ";
    about.append(step + (e.size === undefined ? "" : size(e.size) + " · "), time);
    li.append(name, about);
    rows.prepend(li);
    // Beyond the latest K, the runner deletes them: shown so until the card is fetched again.
    let kept = 0;
    for (const row of rows.children) {
      if (row.classList.contains("pruned")) continue;
      if (keep > 0 && ++kept > keep) {
        row.classList.add("pruned");
        const cell = row.querySelector(".name");
        cell.textContent = row.dataset.name + " ";
        const tag = document.createElement("span");
        tag.className = "tag";
        tag.textContent = "pruned";
        cell.append(tag);
      }
    }
    document.getElementById("checkpoints-note").textContent =
      "The latest " + keep + " " + (keep === 1 ? "is" : "are") + " kept; a restarted job resumes from the newest.";
    document.body.dispatchEvent(new Event("checkpoint-kept"));
  }

  // Metrics: one small SVG line chart per series, drawn from the page's data and then from
  // each metric event (redrawn at most four times a second). The rules follow jobs/metrics.py:
  // x is the step (or the event's ordinal), a non-finite value is a gap, and a step at or
  // before the last one rewinds the series (a resumed run doing those steps again).
  const SVG = "http://www.w3.org/2000/svg";
  const COLORS = ["#3949ab", "#d81b60", "#00897b", "#ef6c00", "#8e24aa", "#6d4c41", "#0288d1", "#7cb342", "#546e7a", "#c62828"];
  const NON_FINITE = ["NaN", "Infinity", "-Infinity"];
  const MAX_POINTS = 4000; // per series in the page; twice that is halved with min/max buckets
  const DRAW_EVERY = 250; // ms
  const CHART = { height: 180, left: 56, right: 14, top: 10, bottom: 24 };
  const metricsData = JSON.parse(document.getElementById("metrics-data").textContent);
  const series = new Map();
  let metricOrdinal = metricsData.events || 0;
  let drawTimer = null, lastDraw = 0;

  function parseValue(raw) {
    if (typeof raw === "number" && isFinite(raw)) return [raw, null];
    if (typeof raw === "string" && NON_FINITE.includes(raw)) return [null, raw];
    return [null, null];
  }

  function fmtValue(v) {
    if (typeof v === "string") return v;
    if (v === null || v === undefined) return "–";
    const a = Math.abs(v);
    if (a !== 0 && (a >= 1e6 || a < 1e-4)) return v.toExponential(5).replace(/\.?0+e/, "e");
    return String(Number(v.toPrecision(6)));
  }

  function fmtTick(v, span) {
    if (v === 0) return "0";
    const a = Math.abs(v);
    if (a >= 1e6 || a < 1e-4) return v.toExponential(1).replace(/\.0e/, "e");
    const places = Math.max(0, Math.min(6, -Math.floor(Math.log10(span)) + 1));
    return String(Number(v.toFixed(places)));
  }

  function fmtX(x) {
    const a = Math.abs(x);
    if (a >= 1e6) return Number((x / 1e6).toPrecision(3)) + "M";
    if (a >= 1e4) return Number((x / 1e3).toPrecision(3)) + "k";
    return String(Number(x.toPrecision(6)));
  }

  function niceTicks(lo, hi, count, integer) {
    const span = hi - lo;
    if (!(span > 0)) return [lo];
    const raw = span / Math.max(1, count);
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const f = raw / mag;
    let step = (f >= 7.5 ? 10 : f >= 3.5 ? 5 : f >= 1.5 ? 2 : 1) * mag;
    if (integer) step = Math.max(1, Math.round(step));
    const out = [];
    for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push(Number(t.toPrecision(12)));
    return out;
  }

  // The same min/max buckets as jobs.metrics.downsample.
  function downsample(points, limit) {
    if (points.length <= limit) return points;
    const buckets = Math.floor(limit / 5), size = points.length / buckets, kept = [];
    for (let b = 0; b < buckets; b++) {
      const start = Math.floor(b * size), end = b < buckets - 1 ? Math.floor((b + 1) * size) : points.length;
      if (start >= end) continue;
      const chosen = new Set([start, end - 1]);
      let low = -1, high = -1, gap = -1;
      for (let i = start; i < end; i++) {
        const v = points[i][1];
        if (v === null) { if (gap < 0) gap = i; continue; }
        if (low < 0 || v < points[low][1]) low = i;
        if (high < 0 || v > points[high][1]) high = i;
      }
      for (const i of [low, high, gap]) if (i >= 0) chosen.add(i);
      for (const i of [...chosen].sort((a, b) => a - b)) kept.push(points[i]);
    }
    return kept;
  }

  function el(name, attrs, parent) {
    const node = document.createElementNS(SVG, name);
    for (const key in attrs) node.setAttribute(key, attrs[key]);
    if (parent) parent.appendChild(node);
    return node;
  }

  function findRow(name) {
    for (const row of document.getElementById("metric-rows").children) if (row.dataset.series === name) return row;
    return null;
  }

  function makeRow(name) {
    const row = document.createElement("tr");
    row.dataset.series = name;
    row.innerHTML = '<td class="mono"><span class="swatch"></span></td><td class="num mono latest"></td><td class="num step"></td>' +
      '<td class="num best"></td><td class="num count"></td>';
    row.firstChild.append(name);
    document.getElementById("metric-rows").appendChild(row);
    return row;
  }

  function ensureSeries(name, summary) {
    let s = series.get(name);
    if (s) return s;
    summary = summary || {};
    s = {
      name: name,
      color: COLORS[series.size % COLORS.length],
      points: [],
      count: summary.count || 0,
      nonFinite: summary.non_finite || 0,
      mode: summary.mode || null,
      best: summary.best === undefined ? null : summary.best,
      bestX: summary.best_x === undefined ? null : summary.best_x,
      dirty: true,
      hover: null,
    };
    const fig = document.createElement("figure");
    fig.className = "chart";
    fig.dataset.series = name;
    const caption = document.createElement("figcaption");
    const title = document.createElement("span");
    title.className = "name";
    const swatch = document.createElement("span");
    swatch.className = "swatch";
    swatch.style.background = s.color;
    title.append(swatch, name);
    s.readout = document.createElement("span");
    s.readout.className = "readout mono";
    caption.append(title, s.readout);
    s.svg = el("svg", { class: "chart", role: "img", "aria-label": "Chart of " + name + " by step" });
    fig.append(caption, s.svg);
    document.getElementById("metric-charts").appendChild(fig);
    s.fig = fig;
    s.row = findRow(name) || makeRow(name);
    s.row.querySelector(".swatch").style.background = s.color;
    s.svg.addEventListener("mousemove", function (ev) { hover(s, ev); });
    s.svg.addEventListener("mouseleave", function () { s.hover = null; s.dirty = true; scheduleDraw(); });
    series.set(name, s);
    document.getElementById("metrics-table").hidden = false;
    document.getElementById("metrics-empty").hidden = true;
    return s;
  }

  function better(v, best, mode) { return best === null || (mode === "min" ? v < best : v > best); }

  function recomputeBest(s) {
    s.best = s.bestX = null;
    if (!s.mode) return;
    for (const p of s.points) if (p[1] !== null && better(p[1], s.best, s.mode)) { s.best = p[1]; s.bestX = p[0]; }
  }

  function addPoint(s, x, stepped, value, label, at) {
    const pts = s.points;
    if (!stepped && pts.length) x = Math.max(x, pts[pts.length - 1][0] + 1);
    let rewound = false;
    while (pts.length && pts[pts.length - 1][0] >= x) {
      const gone = pts.pop();
      s.count = Math.max(0, s.count - 1);
      if (gone[1] === null) s.nonFinite = Math.max(0, s.nonFinite - 1);
      rewound = true;
    }
    pts.push(label === null ? [x, value, at] : [x, null, at, label]);
    s.count += 1;
    if (value === null) s.nonFinite += 1;
    if (rewound) recomputeBest(s);
    else if (value !== null && s.mode && better(value, s.best, s.mode)) { s.best = value; s.bestX = x; }
    if (pts.length > 2 * MAX_POINTS) s.points = downsample(pts, MAX_POINTS);
    s.dirty = true;
  }

  function addMetric(e) {
    const stepped = Number.isInteger(e.step);
    const x = stepped ? e.step : metricOrdinal;
    metricOrdinal += 1;
    for (const name in e.values || {}) {
      const [value, label] = parseValue(e.values[name]);
      if (value === null && label === null) continue;
      let s = series.get(name);
      if (!s) {
        s = ensureSeries(name);
        s.mode = guessMode(name);
      }
      addPoint(s, x, stepped, value, label, e.at);
    }
    scheduleDraw();
  }

  // As jobs.metrics.best_mode, for a series that first appears live.
  function guessMode(name) {
    if (name === metricsData.early_stop_metric) return metricsData.early_stop_mode;
    const n = name.toLowerCase();
    if (["loss", "err", "perplexity", "ppl", "mse", "mae", "rmse", "nll", "wer", "cer"].some(function (w) { return n.includes(w); })) return "min";
    if (["acc", "f1", "auc", "precision", "recall", "score", "bleu", "rouge", "map", "iou", "r2", "reward"].some(function (w) { return n.includes(w); })) return "max";
    return null;
  }

  function scheduleDraw() {
    if (drawTimer !== null) return;
    drawTimer = setTimeout(function () {
      drawTimer = null;
      lastDraw = Date.now();
      for (const s of series.values()) if (s.dirty) { s.dirty = false; draw(s); updateRow(s); }
    }, Math.max(0, DRAW_EVERY - (Date.now() - lastDraw)));
  }

  function lastOf(s) { return s.points.length ? s.points[s.points.length - 1] : null; }
  function pointValue(p) { return p[1] !== null ? fmtValue(p[1]) : p[3]; }

  function updateRow(s) {
    const last = lastOf(s);
    if (!last) return;
    s.row.querySelector(".latest").textContent = pointValue(last);
    s.row.querySelector(".step").textContent = last[0];
    const best = s.row.querySelector(".best");
    best.textContent = "";
    if (s.best !== null) {
      const v = document.createElement("span");
      v.className = "mono";
      v.textContent = fmtValue(s.best);
      const at = document.createElement("span");
      at.className = "muted small";
      at.textContent = "at " + s.bestX;
      best.append(v, " ", at);
    }
    const count = s.row.querySelector(".count");
    count.textContent = s.count;
    if (s.nonFinite) {
      const bad = document.createElement("span");
      bad.className = "bad small";
      bad.textContent = "(" + s.nonFinite + " not finite)";
      count.append(" ", bad);
    }
  }

  function draw(s) {
    const pts = s.points, svg = s.svg;
    const width = Math.max(200, Math.round(s.fig.clientWidth || 480)), height = CHART.height;
    const pw = width - CHART.left - CHART.right, ph = height - CHART.top - CHART.bottom;
    svg.setAttribute("viewBox", "0 0 " + width + " " + height);
    svg.setAttribute("width", width);
    svg.setAttribute("height", height);
    svg.replaceChildren();
    if (!pts.length) return;
    let x0 = pts[0][0], x1 = pts[pts.length - 1][0];
    if (x1 <= x0) { x0 -= 1; x1 += 1; }
    else if (x0 > 0 && x0 <= (x1 - x0) * 0.05) x0 = 0; // start a run's axis at step 0
    let y0 = Infinity, y1 = -Infinity;
    for (const p of pts) if (p[1] !== null) { if (p[1] < y0) y0 = p[1]; if (p[1] > y1) y1 = p[1]; }
    if (y0 === Infinity) { y0 = 0; y1 = 1; }
    else if (y0 === y1) { const pad = Math.abs(y0) * 0.1 || 1; y0 -= pad; y1 += pad; }
    else { const pad = (y1 - y0) * 0.06; y0 -= pad; y1 += pad; }
    const sx = function (x) { return CHART.left + (x - x0) / (x1 - x0) * pw; };
    const sy = function (y) { return CHART.top + (1 - (y - y0) / (y1 - y0)) * ph; };
    // Grid, ticks and their labels.
    for (const t of niceTicks(y0, y1, 4, false)) {
      const y = sy(t).toFixed(1);
      el("line", { class: "grid", x1: CHART.left, x2: CHART.left + pw, y1: y, y2: y }, svg);
      el("text", { x: CHART.left - 6, y: Number(y) + 4, "text-anchor": "end" }, svg).textContent = fmtTick(t, y1 - y0);
    }
    for (const t of niceTicks(x0, x1, Math.max(2, Math.floor(pw / 90)), true)) {
      const x = sx(t).toFixed(1);
      el("line", { class: "axis", x1: x, x2: x, y1: CHART.top + ph, y2: CHART.top + ph + 4 }, svg);
      el("text", { x: x, y: height - 6, "text-anchor": "middle" }, svg).textContent = fmtX(t);
    }
    el("line", { class: "axis", x1: CHART.left, x2: CHART.left + pw, y1: CHART.top + ph, y2: CHART.top + ph }, svg);
    el("line", { class: "axis", x1: CHART.left, x2: CHART.left, y1: CHART.top, y2: CHART.top + ph }, svg);
    // The line: one polyline per run of finite points (a non-finite value is a gap, marked in
    // red at the top); at most about two points per pixel column (its lowest and highest).
    let segment = [], column = null, low = null, high = null;
    const lines = [], gaps = [];
    function flushColumn() {
      if (column === null) return;
      if (low === high) segment.push(low);
      else if (low[0] <= high[0]) segment.push(low, high);
      else segment.push(high, low);
      column = low = high = null;
    }
    function flushSegment() { flushColumn(); if (segment.length) lines.push(segment); segment = []; }
    for (const p of pts) {
      const px = sx(p[0]);
      if (p[1] === null) { flushSegment(); gaps.push([px, p]); continue; }
      const c = Math.round(px * 2);
      if (c !== column) { flushColumn(); column = c; }
      const q = [px, sy(p[1])];
      if (low === null || q[1] > low[1]) low = q;
      if (high === null || q[1] < high[1]) high = q;
    }
    flushSegment();
    for (const line of lines) {
      const attrs = { stroke: s.color, points: line.map(function (q) { return q[0].toFixed(1) + "," + q[1].toFixed(1); }).join(" ") };
      if (line.length === 1) el("circle", { cx: line[0][0].toFixed(1), cy: line[0][1].toFixed(1), r: 2, fill: s.color }, svg);
      else el("polyline", attrs, svg);
    }
    let lastGap = null;
    for (const [px, p] of gaps) {
      if (lastGap !== null && Math.abs(px - lastGap) < 2) continue;
      lastGap = px;
      const mark = el("line", { class: "nonfinite", x1: px.toFixed(1), x2: px.toFixed(1), y1: CHART.top, y2: CHART.top + 8 }, svg);
      el("title", {}, mark).textContent = p[3] + " at step " + p[0];
    }
    const last = lastOf(s);
    if (last[1] !== null) el("circle", { cx: sx(last[0]).toFixed(1), cy: sy(last[1]).toFixed(1), r: 3, fill: s.color }, svg);
    s.geo = { x0: x0, x1: x1, pw: pw, width: width, sx: sx, sy: sy };
    // The readout: the point under the pointer, else the latest.
    const shown = s.hover || last;
    if (s.hover) {
      const gx = sx(shown[0]).toFixed(1);
      el("line", { class: "guide", x1: gx, x2: gx, y1: CHART.top, y2: CHART.top + ph }, svg);
      if (shown[1] !== null) el("circle", { class: "focus", cx: gx, cy: sy(shown[1]).toFixed(1), r: 4, stroke: s.color }, svg);
    }
    s.readout.textContent = (s.hover ? "" : "latest ") + pointValue(shown) + " at step " + shown[0] +
      (s.hover && shown[2] ? " · " + new Date(shown[2]).toISOString().substring(11, 19) : "");
  }

  function hover(s, ev) {
    if (!s.geo || !s.points.length) return;
    const rect = s.svg.getBoundingClientRect();
    const px = (ev.clientX - rect.left) * (s.geo.width / rect.width);
    const x = s.geo.x0 + (px - CHART.left) / s.geo.pw * (s.geo.x1 - s.geo.x0);
    const pts = s.points;
    let lo = 0, hi = pts.length - 1;
    while (lo < hi) { const mid = (lo + hi) >> 1; if (pts[mid][0] < x) lo = mid + 1; else hi = mid; }
    if (lo > 0 && Math.abs(pts[lo - 1][0] - x) < Math.abs(pts[lo][0] - x)) lo -= 1;
    if (s.hover !== pts[lo]) { s.hover = pts[lo]; draw(s); }
  }

  function startMetrics() {
    const names = Object.keys(metricsData.series).sort();
    for (const name of names) {
      const s = ensureSeries(name, metricsData.summary[name]);
      s.points = metricsData.series[name];
    }
    for (const s of series.values()) { s.dirty = false; draw(s); updateRow(s); }
    let width = document.getElementById("metric-charts").clientWidth;
    window.addEventListener("resize", function () {
      const now = document.getElementById("metric-charts").clientWidth;
      if (now === width) return;
      width = now;
      for (const s of series.values()) s.dirty = true;
      scheduleDraw();
    });
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
  const timeline = document.getElementById("timeline");
  timeline.scrollTop = timeline.scrollHeight;
  startMetrics();
  connect();
})();
