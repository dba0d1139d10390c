"use strict";
// Lays out what harness/report/html.py computed: overview, charts (inline SVG), runs viewer.
// No network, no libraries: the page must open anywhere, years later.
(function () {
  const DATA = JSON.parse(document.getElementById("report-data").textContent);
  const PAGE_SIZE = 25; // blocks per page
  const GROUP_LIMIT = 40; // entries shown per block until "show more" is pressed (an entry: runs that show the same)
  const SVGNS = "http://www.w3.org/2000/svg";
  const PALETTE = ["#3451b2", "#c2410c", "#2f7d4f", "#9333ea", "#b3261e", "#0e7490", "#a16207", "#475569"];

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") node.className = v; else if (k === "text") node.textContent = v; else node.setAttribute(k, v);
    }
    for (const c of children.flat()) if (c !== null && c !== undefined) node.append(c instanceof Node ? c : String(c));
    return node;
  }
  function svg(tag, attrs, ...children) {
    const node = document.createElementNS(SVGNS, tag);
    for (const [k, v] of Object.entries(attrs || {})) if (v !== null && v !== undefined) node.setAttribute(k, v);
    for (const c of children.flat()) if (c !== null && c !== undefined) node.append(c instanceof Node ? c : String(c));
    return node;
  }
  const num = (v, d = 3) => (v === null || v === undefined ? "–" : Number(v).toPrecision(d).replace(/\.?0+(e|$)/, "$1"));
  const pct = (v) => (v === null || v === undefined ? "–" : (100 * v).toFixed(v === 1 || v === 0 ? 0 : 1) + " %");
  const kv = (obj) => el("table", {}, Object.entries(obj).map(([k, v]) => el("tr", {}, el("th", { text: k }), el("td", { text: v }))));

  // ---------- overview ----------
  function overview() {
    const m = DATA.meta;
    document.getElementById("title").textContent = `${m.experiment}: determinism report`;
    document.getElementById("description").textContent = m.description;
    const statuses = el("div", {}, Object.entries(m.statuses).map(([s, n]) => el("span", {}, el("span", { class: `badge ${s}`, text: s }), ` ${n} `)));
    const matrix = {};
    for (const [axis, values] of Object.entries(m.matrix)) matrix[axis] = values.join(", ");
    const prov = {};
    for (const [k, v] of Object.entries(m.provenance)) {
      if (k === "library_versions" && v) {
        prov[k] = v.split("; ").map((one) => {
          try { return Object.entries(JSON.parse(one)).map(([a, b]) => `${a} ${b}`).join(", "); } catch (e) { return one; }
        }).join(" | ");
      } else prov[k] = v || "–";
    }
    const facts = { results: m.results, cells: m.cells, "max tokens": m.max_tokens.join(", "), reference: m.reference,
                    "run ids": m.run_ids.join(", "), "report made": m.generated_at };
    document.getElementById("overview-body").append(
      el("p", {}, "Rows by status: ", statuses),
      el("div", { class: "cols" },
        el("div", {}, el("h3", { text: "Experiment" }), kv(facts)),
        el("div", {}, el("h3", { text: "Matrix" }), kv(matrix)),
        el("div", {}, el("h3", { text: "Provenance" }), kv(prov))));
    const g = DATA.guarantees;
    if (g.settings.length) {
      document.getElementById("overview-body").append(el("h3", { text: "Guarantee per setting" }),
        el("ul", { class: "guarantees" }, g.settings.map((s) => el("li", {},
          el("span", { class: `badge ${s.guarantee}`, text: s.guarantee.replace("_", " ") }), ` ${s.setting}: ${s.evidence}`))));
    }
    if (g.likely_bugs.length) {
      document.getElementById("overview-body").append(
        el("h3", { class: "bug", text: `Likely bugs: ${g.likely_bugs.length} confident flip(s)` }),
        el("p", { class: "note", text: `Runs that departed where the reference's top-1 led top-2 by ${g.confident_margin} nats or more: rounding does not move logits that far.` }),
        el("ul", {}, g.likely_bugs.map((b) => el("li", {},
          `${b.setting}: ${b.prompt} repeat ${b.repeat} at token ${b.token} (margin ${b.margin.toFixed(2)}; cell ${b.cell})`))));
    }
    const located = DATA.located || [];
    if (located.length) {
      document.getElementById("overview-body").append(
        el("h3", { text: `Why runs split: ${located.length} traced step(s)` }),
        el("p", { class: "note", text: "harness locate: each pass rebuilt as it ran and traced module by module; the first operation whose output differs from the reference run's." }),
        el("ul", { class: "located" }, located.map((s) => el("li", {},
          `${s.setting} / ${s.prompt} repeat ${s.repeat}, ${s.step_kind} (step ${s.step}): ${s.finding}`))));
    }
  }

  // ---------- charts ----------
  function chartBox(title, note, body) {
    return el("div", { class: "chart" }, el("h3", { text: title }), body, note ? el("p", { class: "note", text: note }) : null);
  }
  // Ticks at round steps (1, 2 or 5 times a power of ten) from 0 to max.
  function axisTicks(g, x0, x1, y, max, fmt, count = 5) {
    const raw = max / count, power = Math.pow(10, Math.floor(Math.log10(raw || 1)));
    const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw) || raw;
    for (let v = 0; v <= max + step * 1e-9; v += step) {
      const x = x0 + ((x1 - x0) * v) / max;
      g.append(svg("line", { x1: x, x2: x, y1: y, y2: y + 4, stroke: "#888" }), svg("text", { x, y: y + 15, "text-anchor": "middle" }, fmt(v)));
    }
  }
  // Room for bar labels on the left: about 7.5 px per character at 14 px, within limits.
  const labelRoom = (labels) => Math.max(120, Math.min(360, 16 + 7.5 * Math.max(...labels.map((l) => l.length))));
  function identicalChart(recs) {
    if (!recs.length) return chartBox("Runs identical to the reference", null, el("p", { class: "empty", text: "No run had a reference to compare with." }));
    const series = [...new Set(recs.map((r) => r.series))];
    const rowH = 20, right = 600, top = 8;
    const left = labelRoom(recs.map((r) => `${r.series} · batch ${r.batch_size}`));
    const h = top + recs.length * rowH + series.length * 8 + 26;
    const s = svg("svg", { viewBox: `0 0 680 ${h}`, role: "img", "aria-label": "share identical" });
    let y = top;
    series.forEach((name, si) => {
      for (const r of recs.filter((q) => q.series === name)) {
        const w = (right - left) * r.share;
        s.append(svg("text", { x: left - 6, y: y + 13, "text-anchor": "end" }, `${name} · batch ${r.batch_size}`));
        s.append(svg("rect", { x: left, y: y + 2, width: right - left, height: rowH - 5, fill: "#f1d2cf" }));
        s.append(svg("rect", { x: left, y: y + 2, width: w, height: rowH - 5, fill: PALETTE[si % PALETTE.length] }, svg("title", {}, `${r.identical} of ${r.compared} identical`)));
        s.append(svg("text", { x: right + 6, y: y + 13 }, `${r.identical}/${r.compared}`));
        y += rowH;
      }
      y += 8;
    });
    axisTicks(s, left, right, y, 1, (v) => `${Math.round(v * 100)}%`, 4);
    return chartBox("Runs identical to the reference", `Coloured: identical to the reference (${DATA.meta.reference}); pale red: departed.`, s);
  }
  // One legend entry per setting (series · batch): colour swatch and label, below a chart.
  function legend(s, names, y) {
    names.forEach((name, i) => {
      const x = 40 + (i % 2) * 320, yy = y + Math.floor(i / 2) * 16;
      s.append(svg("rect", { x, y: yy - 9, width: 10, height: 10, fill: PALETTE[i % PALETTE.length] }),
        svg("text", { x: x + 14, y: yy }, name));
    });
    return y + Math.ceil(names.length / 2) * 16;
  }
  const settingOf = (r) => `${r.series} · batch ${r.batch_size}`;
  function histogram(recs) {
    if (!recs.length) return chartBox("Where runs first depart", null, el("p", { class: "empty", text: "No run departed from its reference." }));
    const names = [...new Set(recs.map(settingOf))];
    const max = Math.max(...recs.map((r) => r.first_divergence)) + 1, total = recs.reduce((n, r) => n + r.runs, 0);
    const bins = Math.min(24, max), width = Math.ceil(max / bins), nbins = Math.ceil(max / width);
    // counts[bin][setting]: the bars stack one colour per setting, so no setting hides in another's bar
    const counts = Array.from({ length: nbins }, () => new Array(names.length).fill(0));
    recs.forEach((r) => { counts[Math.floor(r.first_divergence / width)][names.indexOf(settingOf(r))] += r.runs; });
    const left = 40, right = 660, base = 170, top = 10, peak = Math.max(...counts.map((c) => c.reduce((a, b) => a + b, 0)));
    const h = base + 30 + Math.ceil(names.length / 2) * 16;
    const s = svg("svg", { viewBox: `0 0 680 ${h}`, role: "img", "aria-label": "first divergence histogram" });
    const bw = (right - left) / nbins;
    counts.forEach((c, i) => {
      let y = base;
      c.forEach((n, si) => {
        if (!n) return;
        const hgt = ((base - top) * n) / peak;
        y -= hgt;
        s.append(svg("rect", { x: left + i * bw + 1, y, width: bw - 2, height: hgt, fill: PALETTE[si % PALETTE.length] },
          svg("title", {}, `${names[si]}, tokens ${i * width}–${(i + 1) * width - 1}: ${n} run(s)`)));
      });
      const sum = c.reduce((a, b) => a + b, 0);
      if (sum) s.append(svg("text", { x: left + i * bw + bw / 2, y: y - 3, "text-anchor": "middle" }, sum));
    });
    s.append(svg("line", { x1: left, x2: right, y1: base, y2: base, stroke: "#888" }));
    axisTicks(s, left, right, base, nbins * width, (v) => Math.round(v), Math.min(8, nbins));
    legend(s, names, base + 34);
    return chartBox("Where runs first depart", `${total} run(s) departed; x: token position of the first difference, bins of ${width}; one colour per setting.`, s);
  }
  function marginChart(recs) {
    const pts = recs.filter((r) => r.margin_run !== null && r.margin_reference !== null);
    if (!pts.length) return chartBox("How close the decision was where runs split", null, el("p", { class: "empty", text: "No divergence with recorded margins." }));
    const max = Math.max(...pts.map((p) => Math.max(p.margin_run, p.margin_reference))) * 1.1 || 1;
    const left = 66, right = 660, top = 10, base = 200;
    const names = [...new Set(pts.map(settingOf))];
    const s = svg("svg", { viewBox: `0 0 680 ${236 + Math.ceil(names.length / 2) * 16}`, role: "img", "aria-label": "margins at divergence" });
    const X = (v) => left + ((right - left) * v) / max, Y = (v) => base - ((base - top) * v) / max;
    s.append(svg("line", { x1: X(0), y1: Y(0), x2: X(max), y2: Y(max), stroke: "#bbb", "stroke-dasharray": "4 3" }));
    s.append(svg("line", { x1: left, x2: right, y1: base, y2: base, stroke: "#888" }), svg("line", { x1: left, x2: left, y1: top, y2: base, stroke: "#888" }));
    axisTicks(s, left, right, base, max, (v) => num(v, 2), 5);
    for (let i = 0; i <= 4; i++) s.append(svg("text", { x: left - 4, y: Y((max * i) / 4) + 4, "text-anchor": "end" }, num((max * i) / 4, 2)));
    pts.forEach((p) => s.append(svg("circle", { cx: X(p.margin_reference), cy: Y(p.margin_run), r: 4, fill: PALETTE[names.indexOf(settingOf(p)) % PALETTE.length], "fill-opacity": 0.7 },
      svg("title", {}, `${p.prompt_id}, ${p.series}, batch ${p.batch_size}, token ${p.first_divergence}: reference ${num(p.margin_reference)}, run ${num(p.margin_run)}`))));
    legend(s, names, 236);
    return chartBox("How close the decision was where runs split",
      "Top-1 minus top-2 logit margin at the first differing token: x in the reference run, y in the departing run. Near zero: a near tie that the batch flipped.", s);
  }
  function slowdownChart(recs) {
    if (!recs.length) return chartBox("What batch-invariant mode costs", null, el("p", { class: "empty", text: "No cells differing only in batch_invariant ran OK, so there is no slowdown to show." }));
    const right = 600, rowH = 22, top = 8, h = top + recs.length * rowH + 30;
    const left = labelRoom(recs.map(settingOf));
    const max = Math.max(1.1, ...recs.map((r) => r.throughput_ratio_max || r.throughput_ratio)) * 1.05;
    const s = svg("svg", { viewBox: `0 0 680 ${h}`, role: "img", "aria-label": "slowdown" });
    const X = (v) => left + ((right - left) * v) / max;
    recs.forEach((r, i) => {
      const y = top + i * rowH;
      s.append(svg("text", { x: left - 6, y: y + 14, "text-anchor": "end" }, settingOf(r)));
      s.append(svg("rect", { x: left, y: y + 3, width: X(r.throughput_ratio) - left, height: rowH - 8, fill: "#9333ea", "fill-opacity": 0.75 }));
      s.append(svg("line", { x1: X(r.throughput_ratio_min), x2: X(r.throughput_ratio_max), y1: y + rowH / 2, y2: y + rowH / 2, stroke: "#000" }));
      s.append(svg("text", { x: Math.max(X(r.throughput_ratio_max), X(r.throughput_ratio)) + 6, y: y + 14 }, `×${num(r.throughput_ratio)} (${r.pairs} pairs)`));
    });
    const yb = top + recs.length * rowH;
    s.append(svg("line", { x1: X(1), x2: X(1), y1: top, y2: yb, stroke: "#b3261e", "stroke-dasharray": "3 3" }));
    axisTicks(s, left, right, yb, max, (v) => num(v, 2), 4);
    return chartBox("What batch-invariant mode costs", "Throughput with the mode off ÷ on (median bar, range over paired batches; above 1: the mode is slower). Below: serving latency over the same pairs, p50 / p90 / p99 in ms with the mode off and on, and on ÷ off (definitions: docs/rows.md, Latency).",
      el("div", {}, s, servingTable(recs)));
  }
  // TTFT, ITL, TPOT and E2EL percentiles per setting, off and on, where the rows recorded them.
  function servingTable(recs) {
    const metrics = [["ttft", "TTFT"], ["itl", "ITL"], ["tpot", "TPOT"], ["e2el", "E2EL"]], ps = [50, 90, 99];
    const ms = (v) => (v === null || v === undefined ? "–" : (1000 * v).toFixed(1));
    const rows = [];
    recs.forEach((r) => metrics.forEach(([m, title]) => {
      if (ps.every((p) => r[`${m}_p${p}_off`] === null || r[`${m}_p${p}_off`] === undefined)) return;
      rows.push(el("tr", {}, el("td", { text: settingOf(r) }), el("td", { text: title }),
        el("td", { text: ps.map((p) => ms(r[`${m}_p${p}_off`])).join(" / ") }),
        el("td", { text: ps.map((p) => ms(r[`${m}_p${p}_on`])).join(" / ") }),
        el("td", { text: ps.map((p) => num(r[`${m}_p${p}_ratio`])).join(" / ") })));
    }));
    if (!rows.length) return null;
    return el("table", { class: "serving" }, el("tr", {}, ["setting", "metric", "off, ms", "on, ms", "on ÷ off"].map((t) => el("th", { text: t }))), rows);
  }
  // Share of runs still identical to the reference after t tokens: one step line per setting, its
  // pointwise 95 % band shaded (harness/survival.py).
  function survivalChart(recs) {
    const title = "Survival of agreement";
    if (!recs || !recs.length) return chartBox(title, null, el("p", { class: "empty", text: "No run had a reference to compare with." }));
    const names = [...new Set(recs.map(settingOf))];
    const left = 48, right = 660, top = 10, base = 190;
    const maxT = Math.max(1, ...recs.map((r) => r.tokens));
    const X = (t) => left + ((right - left) * t) / maxT, Y = (v) => base - (base - top) * v;
    const s = svg("svg", { viewBox: `0 0 680 ${base + 40 + Math.ceil(names.length / 2) * 16}`, role: "img", "aria-label": "survival of agreement" });
    s.append(svg("line", { x1: left, x2: right, y1: base, y2: base, stroke: "#888" }), svg("line", { x1: left, x2: left, y1: top, y2: base, stroke: "#888" }));
    for (let i = 0; i <= 4; i++) s.append(svg("text", { x: left - 4, y: Y(i / 4) + 4, "text-anchor": "end" }, `${25 * i}%`));
    axisTicks(s, left, right, base, maxT, (v) => Math.round(v), 6);
    names.forEach((name, si) => {
      const pts = recs.filter((r) => settingOf(r) === name).sort((a, b) => a.tokens - b.tokens);
      const colour = PALETTE[si % PALETTE.length];
      let line = "", upper = "", lower = "";
      pts.forEach((p, i) => {
        const x = X(p.tokens), xn = X(i + 1 < pts.length ? pts[i + 1].tokens : p.tokens);
        line += `${i ? "L" : "M"}${x},${Y(p.identical)} L${xn},${Y(p.identical)} `;
        upper += `${i ? "L" : "M"}${x},${Y(p.high)} L${xn},${Y(p.high)} `;
        lower = `L${xn},${Y(p.low)} L${x},${Y(p.low)} ` + lower;
      });
      s.append(svg("path", { d: upper + lower + "Z", fill: colour, "fill-opacity": 0.12, stroke: "none" }));
      s.append(svg("path", { d: line, fill: "none", stroke: colour, "stroke-width": 2 },
        svg("title", {}, `${name}: ${pts.map((p) => `${p.tokens} tokens ${pct(p.identical)} (${p.at_risk} at risk)`).join("; ")}`)));
    });
    legend(s, names, base + 34);
    return chartBox(title, `Share of runs still identical to the reference (${DATA.meta.reference}) after t tokens: Kaplan-Meier, a run that stays identical counted until its output ends; shaded: pointwise 95% band.`, s);
  }
  // How a traced difference grows through the model: per traced step (harness locate), the largest
  // difference from the reference run's pass at each layer and at the logits, on a log scale.
  function locatedChart(recs) {
    const title = "Why runs split: the difference layer by layer";
    if (!recs || !recs.length) return chartBox(title, null, el("p", { class: "empty", text: "No traced step (run harness locate, then the report again)." }));
    const traces = [...new Set(recs.map((r) => r.trace))];
    const layers = Math.max(0, ...recs.map((r) => r.layer)) + 1;  // the logits (-1) drawn after the last layer
    const at = (r) => (r.layer < 0 ? layers : r.layer);
    const positive = recs.map((r) => r.max_abs_diff).filter((v) => v > 0);
    const hi = Math.log10(Math.max(...positive, 1e-12)), lo = Math.log10(Math.min(...positive, 1)) - 1;
    const left = 56, right = 660, top = 10, base = 190;
    const X = (i) => left + ((right - left) * i) / Math.max(1, layers), Y = (v) => base - ((base - top) * ((v > 0 ? Math.log10(v) : lo) - lo)) / Math.max(1e-9, hi - lo);
    const s = svg("svg", { viewBox: `0 0 680 ${base + 40 + Math.ceil(traces.length / 2) * 16}`, role: "img", "aria-label": "difference by layer" });
    s.append(svg("line", { x1: left, x2: right, y1: base, y2: base, stroke: "#888" }), svg("line", { x1: left, x2: left, y1: top, y2: base, stroke: "#888" }));
    for (let e = Math.ceil(lo); e <= Math.floor(hi); e++) s.append(svg("text", { x: left - 4, y: Y(Math.pow(10, e)) + 4, "text-anchor": "end" }, `1e${e}`));
    s.append(svg("text", { x: left - 4, y: base + 4, "text-anchor": "end" }, "0"));
    axisTicks(s, left, X(Math.max(1, layers - 1)), base, Math.max(1, layers - 1), (v) => Math.round(v), 6);
    s.append(svg("text", { x: X(layers), y: base + 15, "text-anchor": "middle" }, "logits"));
    traces.forEach((name, ti) => {
      const pts = recs.filter((r) => r.trace === name).sort((a, b) => at(a) - at(b));
      const colour = PALETTE[ti % PALETTE.length];
      s.append(svg("path", { d: pts.map((p, i) => `${i ? "L" : "M"}${X(at(p))},${Y(p.max_abs_diff)}`).join(" "), fill: "none", stroke: colour, "stroke-width": 2 },
        svg("title", {}, `${name}: ${pts.map((p) => `${p.layer < 0 ? "logits" : "layer " + p.layer} ${num(p.max_abs_diff)}`).join("; ")}`)));
    });
    legend(s, traces, base + 34);
    return chartBox(title, "Per traced step (harness locate): the largest |difference| from the reference run's pass among each layer's ops, and at the logits; log scale, 0 drawn at the bottom. Where the lines leave the bottom is where the passes first differ.", s);
  }
  // The chance per step that a run departs, by how close its reference's call was there (harness/near_ties.py).
  function flipChart(recs) {
    const title = "Where runs split, by how close the call was";
    const flipped = (recs || []).filter((r) => r.flips > 0);
    if (!flipped.length) return chartBox(title, null, el("p", { class: "empty", text: "No run departed at a step with a recorded margin." }));
    const buckets = [...new Set(recs.map((r) => r.bucket))];
    const names = [...new Set(recs.map(settingOf))];
    const left = 56, right = 660, top = 10, base = 190;
    const max = Math.max(...recs.map((r) => r.flip_rate || 0)) * 1.1 || 1;
    const X = (i) => left + ((right - left) * (i + 0.5)) / buckets.length, Y = (v) => base - ((base - top) * v) / max;
    const s = svg("svg", { viewBox: `0 0 680 ${base + 40 + Math.ceil(names.length / 2) * 16}`, role: "img", "aria-label": "flips by margin" });
    s.append(svg("line", { x1: left, x2: right, y1: base, y2: base, stroke: "#888" }), svg("line", { x1: left, x2: left, y1: top, y2: base, stroke: "#888" }));
    for (let i = 0; i <= 4; i++) s.append(svg("text", { x: left - 4, y: Y((max * i) / 4) + 4, "text-anchor": "end" }, pct((max * i) / 4)));
    buckets.forEach((b, i) => s.append(svg("text", { x: X(i), y: base + 15, "text-anchor": "middle" }, b)));
    names.forEach((name, si) => {
      const colour = PALETTE[si % PALETTE.length];
      recs.filter((r) => settingOf(r) === name && r.flip_rate !== null).forEach((r) => {
        s.append(svg("circle", { cx: X(buckets.indexOf(r.bucket)) + (si - names.length / 2) * 4, cy: Y(r.flip_rate), r: 4, fill: colour },
          svg("title", {}, `${name}, margin ${r.bucket}: ${r.flips} departure(s) in ${r.steps} step(s) at risk`)));
      });
    });
    legend(s, names, base + 34);
    return chartBox(title, "x: the reference's top-1 minus top-2 margin at a step; y: runs departing at such a step, per step at risk. Batch-induced splits sit on near ties; a difference in weights moves wider margins too.", s);
  }
  function probeTable(recs) {
    const box = document.getElementById("probe-body");
    if (!recs.length) return;
    box.append(el("h3", { text: "Logit probes (against the same prompt decoded alone)" }),
      el("table", {}, el("tr", {}, ["setting", "batch", "runs", "steps compared", "steps with moved logits", "logits moved", "share moved", "max |Δ logit|", "steps with margin < 0.1"].map((t) => el("th", { text: t }))),
        recs.map((r) => el("tr", {}, el("td", { text: r.series }), el("td", { class: "num", text: r.batch_size }), el("td", { class: "num", text: r.runs }),
          el("td", { class: "num", text: r.steps }), el("td", { class: "num", text: r.steps_differed }),
          el("td", { class: "num", text: `${r.logits_differed} of ${r.logits_compared}` }), el("td", { class: "num", text: pct(r.moved_share) }),
          el("td", { class: "num", text: num(r.max_abs_diff) }), el("td", { class: "num", text: pct(r.low_margin_frac) })))));
  }
  function answerTable(recs) {
    const box = document.getElementById("probe-body");
    if (!recs || !recs.length) return;
    const ci = (v, lo, hi) => v === null ? "–" : `${pct(v)} [${pct(lo)}, ${pct(hi)}]`;
    const pts = (v) => v === null ? "–" : `${v >= 0 ? "+" : ""}${(100 * v).toFixed(1)}`;
    box.append(el("h3", { id: "answers", text: `Answers (reference: ${recs[0].reference})` }),
      el("table", {}, el("tr", {}, ["setting", "batch", "prompts", "TARr", "TARa", "accuracy [95% CI]", "best / worst", "answers = reference", "prompts changed", "accuracy diff, points [95% CI]"].map((t) => el("th", { text: t }))),
        recs.map((r) => el("tr", {}, el("td", { text: r.series }), el("td", { class: "num", text: r.batch_size }), el("td", { class: "num", text: r.prompts }),
          el("td", { class: "num", text: pct(r.tar_r) }), el("td", { class: "num", text: pct(r.tar_a) }),
          el("td", { class: "num", text: ci(r.accuracy, r.accuracy_low, r.accuracy_high) }),
          el("td", { class: "num", text: `${pct(r.best)} / ${pct(r.worst)}` }), el("td", { class: "num", text: pct(r.answer_agreement) }),
          el("td", { class: "num", text: pct(r.prompts_changed) }),
          el("td", { class: "num", text: r.accuracy_diff === null ? "–" : `${pts(r.accuracy_diff)} [${pts(r.diff_low)}, ${pts(r.diff_high)}]` })))));
  }
  function splitTable(data) {
    const box = document.getElementById("probe-body");
    if (!data || !data.records.length) return;
    const note = data.left_out ? ` (the largest shown; ${data.left_out} more records in 'harness summarize --what splits')` : "";
    box.append(el("h3", { id: "splits", text: "Where the outputs split" + note }),
      el("p", { class: "hint", text: "Per setting and prompt: at each token index where runs part, the branches, how many runs take each, and the token each takes (⏎ marks a newline; <end>: the output ends there)." }),
      el("table", {}, el("tr", {}, ["setting", "prompt", "split at token", "branch", "token", "runs", "share", "unique outputs"].map((t) => el("th", { text: t }))),
        data.records.map((r) => el("tr", { class: r.branch === 0 ? "split-first" : null },
          el("td", { text: r.branch === 0 ? r.series : "" }), el("td", { text: r.branch === 0 ? r.prompt_id : "" }),
          el("td", { class: "num", text: r.branch === 0 ? "  ".repeat(r.depth) + (r.depth ? "└ " : "") + r.split_at : "" }),
          el("td", { class: "num", text: r.branch }),
          el("td", {}, el("code", { text: JSON.stringify(String(r.token_text)).slice(1, -1).replace(/\\n/g, "⏎") })),
          el("td", { class: "num", text: r.runs }), el("td", { class: "num", text: pct(r.share) }),
          el("td", { class: "num", text: r.unique_outputs })))));
  }
  function charts() {
    const c = DATA.charts;
    document.getElementById("chart-grid").append(identicalChart(c.identical), histogram(c.divergence), marginChart(c.margins), survivalChart(c.survival), flipChart(c.flips_by_margin), slowdownChart(c.slowdown), locatedChart(c.located_layers));
    probeTable(c.probes);
    answerTable(c.answers);
    splitTable(c.splits);
  }

  // ---------- runs viewer ----------
  const AXES_SHOWN = DATA.filters;
  const settingLabel = (s) => AXES_SHOWN.map((a) => `${a}=${s[a]}`).join(" ");
  function buildGroups() {
    const groups = new Map(), order = Object.keys(DATA.prompts);
    for (const run of DATA.runs) {
      const key = run.status !== "ok" ? `${run.prompt}|${run.cell}|${run.status}` : `${run.prompt}|${run.ref ? run.cell : (run.refcell || run.cell)}`;
      if (!groups.has(key)) groups.set(key, { key, prompt: run.prompt, runs: [], ref: null, status: run.status });
      const g = groups.get(key);
      if (run.ref) g.ref = run; else g.runs.push(run);
    }
    const rank = (p) => (order.indexOf(p) < 0 ? 1e9 : order.indexOf(p));
    const list = [...groups.values()];
    for (const g of list) {
      g.runs.sort((a, b) => JSON.stringify(Object.values(a.s)).localeCompare(JSON.stringify(Object.values(b.s)), undefined, { numeric: true }) || a.repeat - b.repeat);
      g.setting = g.ref ? g.ref.s : (g.runs[0] || {}).s;
    }
    list.sort((a, b) => rank(a.prompt) - rank(b.prompt) || a.prompt.localeCompare(b.prompt) || settingLabel(a.setting).localeCompare(settingLabel(b.setting), undefined, { numeric: true }));
    return list;
  }
  const GROUPS = buildGroups();
  const state = { page: 0, filters: {}, prompt: "", show: "all", expanded: new Set() };

  function passes(run) {
    for (const [axis, value] of Object.entries(state.filters)) if (value !== "" && String(run.s[axis]) !== value) return false;
    if (state.prompt && run.prompt !== state.prompt) return false;
    if (state.show === "diverged") return run.fd !== null && run.fd !== undefined;
    if (state.show === "identical") return run.m === true;
    if (state.show === "problems") return run.status !== "ok";
    return true;
  }
  function visibleGroups() {
    const out = [];
    for (const g of GROUPS) {
      const runs = g.runs.filter(passes);
      const refShown = g.ref && passes(g.ref) && state.show === "all";
      if (runs.length || refShown) out.push({ g, runs });
    }
    return out;
  }
  function tokens(run) {
    const out = DATA.outputs[run.h] || { t: [""] };
    const k = run.fd === undefined ? null : run.fd;
    const box = el("div", { class: "out" });
    if (out.whole) {
      box.append(el("span", { class: "tok whole", text: out.t[0] }));
      if (k !== null) box.prepend(el("div", { class: "hint", text: `departs at token ${k} (this engine gave no per-token text)` }));
      return box;
    }
    out.t.forEach((piece, i) => {
      let cls = "tok";
      if (run.m === true || (k !== null && i < k)) cls += " same";
      else if (k !== null && i === k) cls += " split";
      box.append(el("span", { class: cls, "data-i": i, title: `token ${i}`, text: piece }));
    });
    if (k !== null && k >= out.t.length) box.append(el("span", { class: "tok split ended", "data-i": k, title: `token ${k}`, text: " ⟂ ends here" }));
    if (!out.t.length) box.append(el("span", { class: "hint", text: "(empty output)" }));
    return box;
  }
  const count = (runs) => runs.reduce((n, r) => n + r.count, 0);
  const rangeText = (run) => run.repeats.map(([a, b]) => (a === b ? `${a}` : `${a}–${b}`)).join(", ") +
    (run.ranges_left_out ? ` and ${run.ranges_left_out} more ranges (the rows in cells/ hold them all)` : "");
  function runRow(run, isRef) {
    const listed = run.repeats.flatMap(([a, b]) => Array.from({ length: b - a + 1 }, (_, i) => a + i));
    const attrs = { class: isRef ? "run is-ref" : "run", "data-cell": run.cell, "data-prompt": run.prompt, "data-repeat": run.repeat,
                    "data-repeats": listed.join(" "), "data-count": run.count,
                    "data-status": run.status, "data-fd": run.fd === null || run.fd === undefined ? "" : run.fd };
    for (const a of Object.keys(run.s)) attrs[`data-${a}`] = String(run.s[a]);
    const label = el("div", { class: "label" });
    let verdict;
    if (run.status !== "ok") verdict = el("span", { class: `badge ${run.status}`, text: run.status });
    else if (isRef) verdict = el("span", { class: "badge reference", text: "reference" });
    else if (run.m === true) verdict = el("span", { class: "badge same", text: "identical" });
    else if (run.m === false) verdict = el("span", { class: "badge differs", text: `departs at token ${run.fd}` });
    else verdict = el("span", { class: "badge", text: "no reference run" });
    const which = run.count > 1 ? ` ${run.count} runs, repeats ${rangeText(run)}` : ` repeat ${run.repeat}`;
    label.append(el("div", {}, verdict, which), el("div", { text: settingLabel(run.s) }));
    if (run.n !== undefined) label.append(el("div", { text: `${run.n} tokens${run.tps ? ` · ${num(run.tps)} tok/s${run.count > 1 ? " (median)" : ""}` : ""}` }));
    if (run.margin) label.append(el("div", { text: `margin at split: run ${num(run.margin[0])}, reference ${num(run.margin[1])}` }));
    if (run.probe && run.probe.steps !== null) {
      label.append(el("div", { class: "probe", text: `logits moved: ${run.probe.logits_differed} of ${run.probe.logits_compared} in ${run.probe.steps} steps, max |Δ| ${num(run.probe.max_abs_diff)}` }));
    } else if (run.probe && run.probe.reference) label.append(el("div", { class: "probe", text: `logit probe ${run.probe.reference}` }));
    const body = run.status === "ok" ? tokens(run) : el("div", { class: "out error", text: run.error || "" });
    return el("div", attrs, label, body);
  }
  function render() {
    const vis = visibleGroups();
    const pages = Math.max(1, Math.ceil(vis.length / PAGE_SIZE));
    state.page = Math.min(state.page, pages - 1);
    const slice = vis.slice(state.page * PAGE_SIZE, (state.page + 1) * PAGE_SIZE);
    const box = document.getElementById("groups");
    box.replaceChildren();
    if (!slice.length) box.append(el("p", { class: "empty", text: "No run matches these filters." }));
    for (const { g, runs } of slice) {
      const diverged = runs.filter((r) => r.m === false);
      const head = el("div", { class: "head" }, el("strong", { text: g.prompt }),
        el("span", { text: g.ref ? `reference: ${settingLabel(g.ref.s)}, repeat 0` : (g.status === "ok" ? "no reference run" : g.status) }),
        el("span", { text: g.status !== "ok" ? `${count(runs)} run(s)` : `${count(runs)} run(s) shown, ${count(diverged)} departed${diverged.length ? `, earliest at token ${Math.min(...diverged.map((r) => r.fd))}` : ""}` }),
        DATA.prompts[g.prompt] ? el("span", { class: "prompt", text: DATA.prompts[g.prompt] }) : null);
      const group = el("div", { class: "group", "data-group": g.key }, head);
      if (g.ref) group.append(runRow(g.ref, true));
      const limit = state.expanded.has(g.key) ? runs.length : GROUP_LIMIT;
      runs.slice(0, limit).forEach((r) => group.append(runRow(r, false)));
      if (runs.length > limit) {
        const more = el("button", { type: "button", class: "more", text: `show ${runs.length - limit} more entr${runs.length - limit === 1 ? "y" : "ies"} (${count(runs.slice(limit))} run(s))` });
        more.addEventListener("click", () => { state.expanded.add(g.key); render(); });
        group.append(el("div", { class: "label" }, more));
      }
      box.append(group);
    }
    const shownRuns = slice.reduce((n, v) => n + count(v.runs), 0); // counted whether or not folded
    for (const id of ["pager-top", "pager-bottom"]) {
      const p = document.getElementById(id);
      const prev = el("button", { type: "button", class: "prev", disabled: state.page === 0 ? "disabled" : null, text: "‹ previous" });
      const next = el("button", { type: "button", class: "next", disabled: state.page >= pages - 1 ? "disabled" : null, text: "next ›" });
      prev.addEventListener("click", () => { state.page--; render(); });
      next.addEventListener("click", () => { state.page++; render(); });
      p.replaceChildren(prev, el("span", { class: "page-info", text: `page ${state.page + 1} of ${pages} · ${vis.length} block(s) · ${shownRuns} run(s) on this page` }), next);
    }
  }
  function filters() {
    const form = document.getElementById("filters");
    const values = (axis) => [...new Set(DATA.runs.map((r) => String(r.s[axis])))].sort((a, b) => a.localeCompare(b, undefined, { numeric: true }));
    const select = (name, options, onChange, labelText) => {
      const s = el("select", { name, id: `filter-${name}` }, options.map(([v, t]) => el("option", { value: v, text: t })));
      s.addEventListener("change", () => { onChange(s.value); state.page = 0; render(); });
      form.append(el("label", { for: `filter-${name}` }, labelText || name, s));
    };
    for (const axis of DATA.filters) select(axis, [["", "all"], ...values(axis).map((v) => [v, v])], (v) => { state.filters[axis] = v; });
    select("prompt", [["", "all"], ...[...new Set(DATA.runs.map((r) => r.prompt))].map((p) => [p, p])], (v) => { state.prompt = v; });
    select("show", [["all", "all runs"], ["diverged", "departed only"], ["identical", "identical only"], ["problems", "failed / unsupported / skipped"]], (v) => { state.show = v; }, "show");
  }

  overview();
  charts();
  filters();
  render();
  document.getElementById("footer").textContent = `Made by harness report from ${DATA.meta.results}. Data inline; no network needed.`;
  document.body.setAttribute("data-ready", "1");
})();
