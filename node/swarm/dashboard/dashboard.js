// The node's dashboard: polls GET /status and GET /history of the node that served it and draws them.
// Plain browser JavaScript (no libraries, no build). Each chart's <path> carries data-points = the number
// of points drawn, and <body data-rendered> counts completed refreshes (tests/test_operating.py reads both).
"use strict";
const NS = "http://www.w3.org/2000/svg";
const short = (id) => (id ? id.slice(0, 6) + "…" + id.slice(-6) : "-");
const fmt = (v, d) => (v === null || v === undefined ? "-" : Number(v).toFixed(d));
const ago = (t) => (Date.now() / 1000 - t).toFixed(0) + " s ago";

function el(tag, attrs, text) {
  const e = document.createElementNS(tag === "svg" || attrs.svg ? NS : "http://www.w3.org/1999/xhtml", tag);
  for (const [k, v] of Object.entries(attrs)) if (k !== "svg") e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function table(id, head, rows) {
  const t = document.getElementById(id);
  t.replaceChildren();
  const tr = document.createElement("tr");
  for (const h of head) tr.appendChild(Object.assign(document.createElement("th"), { textContent: h }));
  t.appendChild(tr);
  for (const row of rows) {
    const r = document.createElement("tr");
    for (const c of row.cells) r.appendChild(Object.assign(document.createElement("td"), { textContent: c }));
    if (row.cls) r.className = row.cls;
    t.appendChild(r);
  }
  if (!rows.length) {
    const r = document.createElement("tr");
    r.appendChild(Object.assign(document.createElement("td"), { textContent: "none", colSpan: head.length }));
    t.appendChild(r);
  }
}

// series: [{name, points: [[x, y], ...], dots: bool}]; x and y scaled to the union of all series
function chart(id, series, xLabel) {
  const svg = document.getElementById(id);
  const W = svg.clientWidth || 400, H = svg.clientHeight || 180, L = 44, R = 8, T = 14, B = 22;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.replaceChildren();
  const all = series.flatMap((s) => s.points).filter((p) => p[1] !== null && isFinite(p[1]));
  svg.appendChild(el("line", { svg: 1, x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis" }));
  svg.appendChild(el("line", { svg: 1, x1: L, y1: T, x2: L, y2: H - B, class: "axis" }));
  if (!all.length) {
    svg.appendChild(el("text", { svg: 1, x: L + 8, y: H / 2, class: "tick" }, "no data yet"));
    return 0;
  }
  let [x0, x1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
  let [y0, y1] = [Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
  const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const sy = (y) => H - B - ((y - y0) / (y1 - y0)) * (H - T - B);
  for (const [v, y] of [[y1, T], [y0, H - B]])
    svg.appendChild(el("text", { svg: 1, x: 2, y: y + 4, class: "tick" }, Number(v).toPrecision(3)));
  const xl = xLabel === "s" ? `${x1.toFixed(0)} s` : `${xLabel} ${x1.toFixed(0)}`;
  svg.appendChild(el("text", { svg: 1, x: W - R, y: H - 6, class: "tick", "text-anchor": "end" }, xl));
  svg.appendChild(el("text", { svg: 1, x: L, y: H - 6, class: "tick" }, x0.toFixed(0)));
  let drawn = 0;
  series.forEach((s, i) => {
    const pts = s.points.filter((p) => p[1] !== null && isFinite(p[1]));
    const d = pts.map((p, j) => `${j ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ");
    const path = el("path", { svg: 1, d: d || "M0,0", fill: "none", "stroke-width": 1.5, class: `s${i}`, "data-series": s.name, "data-points": pts.length });
    svg.appendChild(path);
    if (s.dots) for (const p of pts) svg.appendChild(el("circle", { svg: 1, cx: sx(p[0]), cy: sy(p[1]), r: 2.5, class: `dot${i}` }));
    svg.appendChild(el("text", { svg: 1, x: W - R - 4, y: T + 12 * i, class: `tick legend`, "text-anchor": "end" }, s.name));
    drawn += pts.length;
  });
  svg.dataset.points = drawn;
  return drawn;
}

function render(s, h) {
  document.getElementById("peer").textContent = short(s.peer_id);
  const lr = s.learner;
  document.getElementById("summary").textContent =
    `swarm ${s.swarm} · up ${s.uptime_s.toFixed(0)} s · steps ${lr.steps} · tokens ${lr.tokens.toLocaleString()} · ` +
    `${fmt(lr.tokens_per_s, 0)} tok/s · loss ${fmt(lr.loss, 3)} · eval ${fmt(lr.eval_loss, 3)} · rounds merged ` +
    `${s.rounds_merged} · goodput ${s.goodput === null ? "-" : (100 * s.goodput).toFixed(1) + "%"} · sent ` +
    `${(s.bytes_sent / 1e6).toFixed(2)} MB · received ${(s.bytes_received / 1e6).toFixed(2)} MB` +
    (lr.paused ? " · PAUSED" : "");
  chart("loss-chart", [
    { name: "training loss", points: h.steps.map((p) => [p.step, p.loss]) },
    { name: "eval loss", points: h.evals.filter((e) => e.step !== null).map((e) => [e.step, e.loss]), dots: true },
  ], "step");
  chart("rate-chart", [{ name: "tokens/s", points: h.steps.map((p) => [p.step, p.tokens_per_s]) }], "step");
  const t0 = h.samples.length ? h.samples[0].t : 0;
  chart("goodput-chart", [{ name: "goodput", points: h.samples.map((p) => [p.t - t0, p.goodput]) }], "s");
  const count = s.peer_count ?? s.peers.length;
  document.getElementById("peers-title").textContent =
    count > s.peers.length ? `peers (${count}, ${s.peers.length} listed)` : `peers (${count})`;
  table("peers", ["peer", "role", "reachable", "step", "tok/s", "rounds", "record expires"],
    s.peers.map((p) => ({
      cls: p.peer_id === s.peer_id ? "me" : "",
      cells: [
        short(p.peer_id) + (p.peer_id === s.peer_id ? " (this node)" : ""),
        (p.client_mode ? "client learner" : "learner") +
          (p.synchronises.length ? `, synchroniser of ${p.synchronises.join(", ")}` : ""),
        p.reachable ? "yes" : "no", p.step, fmt(p.tokens_per_s, 0), p.rounds, fmt(p.expires_in_s, 1) + " s",
      ],
    })));
  table("fragments", ["fragment", "round", "hash", "synchroniser"],
    s.fragments.map((f) => ({
      cells: [f.fragment, f.round, f.hash.slice(0, 10),
        short(f.synchroniser) + (f.synchroniser === s.peer_id ? " (this node)" : "") + (f.collecting ? ` ${f.collecting}` : "")],
    })));
  table("merges", ["when", "fragment", "round", "signed by", "learners"],
    h.merges.slice().reverse().slice(0, 10).map((m) => ({
      cells: [ago(m.t), m.fragment, m.round, short(m.signer), m.learners.map(short).join(" ")],
    })));
  const counts = Object.entries(s.refused).map(([code, n]) => ({ cls: "bad", cells: ["total", code, n, ""] }));
  table("refusals", ["when", "code", "peer", "why"], counts.concat(
    h.refusals.slice().reverse().slice(0, 10).map((r) => ({ cls: "bad", cells: [ago(r.t), r.code, short(r.peer), r.why] }))));
  document.body.dataset.rendered = Number(document.body.dataset.rendered) + 1;
}

async function refresh() {
  try {
    const [s, h] = await Promise.all([fetch("status"), fetch("history")].map((p) => p.then((r) => r.json())));
    render(s, h);
  } catch (e) {
    document.getElementById("summary").textContent = `cannot read the node: ${e}`;
  }
}
refresh();
setInterval(refresh, 2000);
