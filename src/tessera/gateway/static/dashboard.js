// tessera live page: polls the admin JSON endpoints every 2 s and draws them.
// Plain DOM, no framework, no CDN. All server data goes in through textContent.
"use strict";

(() => {
  const KEY_STORAGE = "tessera.adminKey";
  const POLL_MS = 2000;
  // Today's usage is a query over the audit log: asked less often than the rest.
  const USAGE_MS = 10000;
  const MAX_REJECTION_ROWS = 10;
  const COST_STEP_S = 3600; // the cost chart's bars: one an hour
  const BUCKETS = ["1", "2-4", "5-8", "9-16", "17-32", "33+"];
  const PALETTE = [
    "#4f6bed", "#e0803a", "#2f9e77", "#c2417d", "#8a5cd1",
    "#2b9cc2", "#c9a227", "#d0573f", "#5b8c3a", "#7c7f8c",
  ];
  const SVG_NS = "http://www.w3.org/2000/svg";

  const colors = new Map();
  let timer = null;
  let generation = 0; // bumps on login/logout so a stale poll draws nothing
  let usageCache = { at: 0, value: null };

  class AuthError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  // ---- small helpers ----

  const $ = (id) => document.getElementById(id);

  function el(tag, props = {}, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(props)) {
      if (value === undefined || value === null) continue;
      if (name === "className") node.className = value;
      else if (name === "text") node.textContent = value;
      else node.setAttribute(name, value);
    }
    for (const child of children) {
      if (child !== null && child !== undefined) {
        node.append(child instanceof Node ? child : String(child));
      }
    }
    return node;
  }

  function svg(tag, attrs = {}) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, String(value));
    return node;
  }

  function colorOf(name) {
    if (!colors.has(name)) colors.set(name, PALETTE[colors.size % PALETTE.length]);
    return colors.get(name);
  }

  const MIB = 1024 * 1024;

  function mib(bytes) {
    const value = bytes / MIB;
    return `${value.toFixed(value >= 100 ? 0 : 1)} MiB`;
  }

  function bytesText(bytes) {
    if (bytes === null || bytes === undefined) return "—";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let value = bytes;
    let unit = 0;
    while (value >= 1024 && unit < units.length - 1) {
      value /= 1024;
      unit += 1;
    }
    return unit === 0 ? `${value} B` : `${value.toFixed(value >= 100 ? 0 : 1)} ${units[unit]}`;
  }

  function num(value) {
    if (value === null || value === undefined) return "—";
    return Number(value).toLocaleString("en-US", { maximumFractionDigits: 1 });
  }

  function qpsText(value) {
    if (value === null || value === undefined) return "—";
    return value >= 10 ? value.toFixed(1) : value.toFixed(2);
  }

  function msText(value) {
    if (value === null || value === undefined) return "—";
    return value >= 10 ? `${Math.round(value)} ms` : `${value.toFixed(1)} ms`;
  }

  function timeText(value) {
    if (value === null || value === undefined) return "—";
    const date = typeof value === "number" ? new Date(value * 1000) : new Date(value);
    if (Number.isNaN(date.getTime())) return String(value);
    return date.toLocaleTimeString("en-GB", { hour12: false });
  }

  function emptyRow(columns, text) {
    return el("tr", { className: "empty" }, el("td", { colspan: columns, text }));
  }

  // ---- talking to the server ----

  async function errorMessage(response) {
    try {
      const body = await response.json();
      const error = body && body.error;
      if (typeof error === "string") return error;
      if (error && typeof error.message === "string") return error.message;
    } catch (_) {
      // not JSON: fall through
    }
    return response.statusText || `HTTP ${response.status}`;
  }

  // Resolves to the JSON body, or null for a 404 when `optional`.
  async function getJSON(path, key, optional = false) {
    const response = await fetch(path, {
      headers: { Authorization: `Bearer ${key}` },
      cache: "no-store",
      credentials: "omit",
    });
    if (response.status === 401 || response.status === 403) {
      throw new AuthError(response.status, await errorMessage(response));
    }
    if (optional && response.status === 404) return null;
    if (!response.ok) throw new Error(`${path}: ${await errorMessage(response)}`);
    return response.json();
  }

  async function fetchAll(key) {
    const usageDue = Date.now() - usageCache.at >= USAGE_MS;
    // Relative paths: the page may sit behind a path prefix.
    const [residency, stats, usage] = await Promise.allSettled([
      getJSON("admin/residency", key),
      getJSON("admin/stats", key, true),
      usageDue ? getJSON(`admin/usage?step=${COST_STEP_S}`, key, true) : Promise.resolve(usageCache.value),
    ]);
    const all = [residency, stats, usage];
    const refused = all.find((r) => r.status === "rejected" && r.reason instanceof AuthError);
    if (refused) throw refused.reason;
    if (residency.status === "rejected") throw residency.reason;
    const value = (r) => (r.status === "fulfilled" ? r.value : null);
    if (usageDue) usageCache = { at: Date.now(), value: value(usage) };
    return { residency: residency.value, stats: value(stats), usage: usageCache.value };
  }

  // ---- drawing ----

  function drawBudget(residency) {
    const budget = residency.budget_bytes || 0;
    const used = residency.used_bytes || 0;
    const share = budget > 0 ? (100 * used) / budget : 0;
    $("budget-text").textContent = `${mib(used)} / ${mib(budget)} · ${share.toFixed(1)}%`;
    $("budget-text").classList.toggle("danger", share >= 95);
    $("budget-text").classList.toggle("warn", share >= 80 && share < 95);
    $("budget-peak").textContent = mib(residency.peak_used_bytes || 0);
    $("loads-total").textContent = num(residency.loads_total);
    $("evictions-total").textContent = num(residency.evictions_total);

    const resident = residency.models.filter((m) => m.bytes > 0 && m.state !== "unloaded");
    const segments = resident.map((m) => ({ name: m.name, bytes: m.bytes, color: colorOf(m.name) }));
    const counted = resident.reduce((sum, m) => sum + m.bytes, 0);
    // Models' bytes split shared components between them and add up to the
    // used bytes but for rounding; show only a real remainder.
    if (used - counted > 1024 * 1024) {
      segments.push({ name: "other", bytes: used - counted, color: "#9aa1ad" });
    }
    const bar = $("budget-bar");
    bar.setAttribute("aria-label", `memory budget: ${share.toFixed(1)}% used`);
    bar.replaceChildren(
      ...segments.map((s) => {
        const width = budget > 0 ? Math.min(100, (100 * s.bytes) / budget) : 0;
        const segment = el("div", {
          className: "segment",
          title: `${s.name}: ${bytesText(s.bytes)}`,
          "data-testid": `budget-segment-${s.name}`,
        });
        segment.style.width = `${width}%`;
        segment.style.background = s.color;
        if (width >= 7) segment.append(el("span", { text: s.name }));
        return segment;
      }),
    );
    $("budget-legend").replaceChildren(
      ...segments.map((s) => {
        const swatch = el("i", { className: "swatch" });
        swatch.style.background = s.color;
        return el("li", {}, swatch, el("span", { text: s.name }), el("b", { text: bytesText(s.bytes) }));
      }),
      el("li", { className: "free" }, el("i", { className: "swatch" }), el("span", { text: "free" }),
        el("b", { text: bytesText(Math.max(0, budget - used)) })),
    );
  }

  function stateBadge(state) {
    return el("span", { className: `badge state-${state}`, text: state });
  }

  function drawResident(residency) {
    const resident = residency.models.filter((m) => m.state !== "unloaded");
    const idle = residency.models.length - resident.length;
    $("resident-note").textContent = idle > 0 ? `${idle} more in the repository, not loaded` : "";
    const rows = resident.map((m) => {
      const swatch = el("i", { className: "swatch" });
      swatch.style.background = colorOf(m.name);
      const nameCell = el("td", { className: "name" }, swatch, el("span", { text: m.name }));
      if (m.error) nameCell.append(el("div", { className: "error-text", text: m.error }));
      return el(
        "tr",
        { "data-testid": `model-row-${m.name}` },
        nameCell,
        el("td", {}, stateBadge(m.state)),
        el("td", { className: "num", text: bytesText(m.bytes) }),
        el("td", { className: "num", text: num(m.loads) }),
        el("td", { className: "num", text: num(m.evictions) }),
        el("td", {
          className: `num${m.queue_depth > 0 ? " hot" : ""}`,
          text: num(m.queue_depth),
          "data-testid": `queue-${m.name}`,
        }),
      );
    });
    $("resident-models").replaceChildren(...(rows.length ? rows : [emptyRow(6, "no model is loaded")]));
  }

  function qpsCell(name, qps, maxQps) {
    const bar = el("i", { className: "minibar" });
    bar.style.width = `${maxQps > 0 ? Math.round((100 * qps) / maxQps) : 0}%`;
    return el(
      "td",
      { className: "num qps" },
      el("span", { className: "minibar-track" }, bar),
      el("span", { text: qpsText(qps), "data-testid": `qps-${name}` }),
    );
  }

  function drawTraffic(stats) {
    if (!stats) {
      $("window-note").textContent = "";
      $("traffic").replaceChildren(emptyRow(6, "no data (the server has no /admin/stats)"));
      $("tiers").replaceChildren(emptyRow(5, "no data"));
      return;
    }
    $("window-note").textContent = `last ${stats.window_s} s`;
    const models = [...(stats.models || [])].sort((a, b) => b.qps - a.qps || a.name.localeCompare(b.name));
    const maxQps = Math.max(0, ...models.map((m) => m.qps));
    const rows = models.map((m) =>
      el(
        "tr",
        { "data-testid": `traffic-row-${m.name}` },
        el("td", { className: "name", text: m.name }),
        qpsCell(m.name, m.qps, maxQps),
        el("td", { className: "num", text: msText(m.p50_ms), "data-testid": `p50-${m.name}` }),
        el("td", { className: "num", text: msText(m.p99_ms), "data-testid": `p99-${m.name}` }),
        el("td", { className: "num", text: num(m.requests) }),
        el("td", { className: `num${m.errors > 0 ? " hot" : ""}`, text: num(m.errors) }),
      ),
    );
    $("traffic").replaceChildren(...(rows.length ? rows : [emptyRow(6, "no requests in the window")]));
    const tiers = (stats.tiers || []).map((t) =>
      el(
        "tr",
        { "data-testid": `tier-row-${t.tier}` },
        el("td", {}, el("span", { className: `badge tier-${t.tier}`, text: t.tier })),
        el("td", { className: "num", text: qpsText(t.qps) }),
        el("td", { className: "num", text: msText(t.p50_ms) }),
        el("td", { className: "num", text: msText(t.p99_ms) }),
        el("td", { className: "num", text: num(t.requests) }),
      ),
    );
    $("tiers").replaceChildren(...(tiers.length ? tiers : [emptyRow(5, "no requests in the window")]));
  }

  function drawTenants(stats, usage) {
    const byName = new Map();
    const entry = (name) => {
      const key = name ?? "(no key)";
      if (!byName.has(key)) {
        byName.set(key, { window: null, today: 0, units: 0, errors: 0, deviceS: 0, gbS: 0, seen: false });
      }
      return byName.get(key);
    };
    for (const t of (stats && stats.tenants) || []) entry(t.tenant).window = t.requests;
    for (const row of (usage && usage.usage) || []) {
      if (row.tenant === "") continue; // memory held with no use: no tenant's
      const t = entry(row.tenant);
      t.deviceS += row.device_s || 0;
      t.gbS += (row.byte_s || 0) / 1e9;
      t.seen = true;
      t.today += row.requests || 0;
      t.units += row.units || 0;
      t.errors += row.errors || 0;
    }
    const names = [...byName.keys()].sort(
      (a, b) => byName.get(b).today - byName.get(a).today || a.localeCompare(b),
    );
    const maxUnits = Math.max(0, ...names.map((n) => byName.get(n).units));
    const rows = names.map((name) => {
      const t = byName.get(name);
      const bar = el("i", { className: "minibar" });
      bar.style.width = `${maxUnits > 0 ? Math.round((100 * t.units) / maxUnits) : 0}%`;
      return el(
        "tr",
        { "data-testid": `tenant-row-${name}` },
        el("td", { className: "name", text: name }),
        el("td", { className: "num", text: stats ? num(t.window ?? 0) : "—" }),
        el("td", { className: "num", text: usage ? num(t.today) : "—" }),
        el("td", { className: "num qps" }, el("span", { className: "minibar-track" }, bar),
          el("span", { text: usage ? num(t.units) : "—" })),
        el("td", { className: `num${t.errors > 0 ? " hot" : ""}`, text: usage ? num(t.errors) : "—" }),
        el("td", { className: "num", text: usage ? seconds(t.deviceS) : "—" }),
        el("td", { className: "num", text: usage ? seconds(t.gbS) : "—" }),
      );
    });
    const none = stats || usage ? "no tenant traffic yet" : "no data";
    $("tenants").replaceChildren(...(rows.length ? rows : [emptyRow(7, none)]));
  }

  function seconds(value) {
    return Number(value).toLocaleString("en-US", { maximumFractionDigits: value < 10 ? 2 : 0 });
  }

  // Device-seconds per tenant, one stacked bar a step (an hour) of today.
  function drawCosts(usage) {
    const series = (usage && usage.series) || [];
    const points = series.filter((p) => p.tenant !== "" && p.device_s > 0);
    if (!points.length) {
      $("cost-chart").replaceChildren(el("p", { className: "muted", text: usage ? "no cost yet today" : "no data" }));
      $("cost-legend").replaceChildren();
      return;
    }
    const width = 480;
    const height = 120;
    const base = 100;
    const steps = Math.max(24, ...points.map((p) => Math.round((p.start - usage.since) / usage.step) + 1));
    const slot = width / steps;
    const byStep = new Map();
    for (const p of points) {
      const i = Math.round((p.start - usage.since) / usage.step);
      if (!byStep.has(i)) byStep.set(i, []);
      byStep.get(i).push(p);
    }
    const max = Math.max(...[...byStep.values()].map((ps) => ps.reduce((a, p) => a + p.device_s, 0)));
    const chart = svg("svg", { viewBox: `0 0 ${width} ${height}`, class: "cost", role: "img",
      "aria-label": "device-seconds per tenant per hour" });
    chart.append(svg("line", { x1: 0, x2: width, y1: base + 0.5, y2: base + 0.5, class: "axis" }));
    for (const [i, ps] of byStep) {
      let top = base;
      for (const p of ps.sort((a, b) => a.tenant.localeCompare(b.tenant))) {
        const h = Math.max(1, ((base - 8) * p.device_s) / max);
        top -= h;
        const rect = svg("rect", { x: i * slot + 1, y: top, width: Math.max(1, slot - 2), height: h });
        rect.style.fill = colorOf(`tenant:${p.tenant}`);
        const tip = svg("title");
        tip.textContent = `${p.tenant}, ${new Date(p.start * 1000).toISOString().slice(11, 16)} UTC: `
          + `${seconds(p.device_s)} device-s, ${seconds(p.byte_s / 1e9)} GB-s`;
        rect.append(tip);
        chart.append(rect);
      }
    }
    for (const hour of [0, 6, 12, 18]) {
      const label = svg("text", { x: hour * slot + 2, y: height - 4, class: "label" });
      label.textContent = `${String(hour).padStart(2, "0")}:00`;
      chart.append(label);
    }
    $("cost-chart").replaceChildren(chart);
    const tenants = [...new Set(points.map((p) => p.tenant))].sort();
    $("cost-legend").replaceChildren(...tenants.map((name) => {
      const swatch = el("i", { className: "swatch" });
      swatch.style.background = colorOf(`tenant:${name}`);
      return el("li", { "data-testid": `cost-legend-${name}` }, swatch, el("span", { text: name }));
    }));
  }

  function histogram(name, counts) {
    const width = 240;
    const height = 92;
    const base = 72;
    const slot = width / BUCKETS.length;
    const values = BUCKETS.map((b) => counts[b] || 0);
    const max = Math.max(1, ...values);
    const total = values.reduce((a, b) => a + b, 0);
    const chart = svg("svg", {
      viewBox: `0 0 ${width} ${height}`,
      class: "hist",
      role: "img",
      "aria-label": `batch sizes of ${name}`,
    });
    chart.append(svg("line", { x1: 0, x2: width, y1: base + 0.5, y2: base + 0.5, class: "axis" }));
    BUCKETS.forEach((bucket, i) => {
      const value = values[i];
      const h = value > 0 ? Math.max(2, Math.round(((base - 16) * value) / max)) : 0;
      const x = i * slot + 6;
      const rect = svg("rect", { x, y: base - h, width: slot - 12, height: h, rx: 2 });
      rect.style.fill = colorOf(name);
      const tip = svg("title");
      tip.textContent = `${bucket}: ${value} batches`;
      rect.append(tip);
      const count = svg("text", { x: x + (slot - 12) / 2, y: base - h - 4, class: "count" });
      count.textContent = value > 0 ? String(value) : "";
      const label = svg("text", { x: x + (slot - 12) / 2, y: height - 4, class: "label" });
      label.textContent = bucket;
      chart.append(rect, count, label);
    });
    return el(
      "figure",
      { className: "hist-card", "data-testid": `batch-hist-${name}` },
      el("figcaption", {}, el("span", { text: name }), el("b", { text: `${num(total)} batches` })),
      chart,
    );
  }

  function drawBatches(stats) {
    const sizes = (stats && stats.batch_sizes) || {};
    const names = Object.keys(sizes).sort();
    const target = $("batch-sizes");
    if (!stats) target.replaceChildren(el("p", { className: "muted", text: "no data" }));
    else if (!names.length) target.replaceChildren(el("p", { className: "muted", text: "no batches yet" }));
    else target.replaceChildren(...names.map((name) => histogram(name, sizes[name])));
  }

  // One row per kind of refusal (tenant, model, reason, status): how many, first
  // and last seen; the most recently seen first.
  function groupRejections(rejections) {
    const stamp = (r) => (typeof r.time === "number" ? r.time : Date.parse(r.time) / 1000 || 0);
    const groups = new Map();
    for (const r of rejections) {
      const key = JSON.stringify([r.tenant, r.model, r.reason, r.status]);
      const t = stamp(r);
      const group = groups.get(key);
      if (!group) {
        groups.set(key, { ...r, count: 1, first: r.time, last: r.time, firstT: t, lastT: t });
        continue;
      }
      group.count += 1;
      if (t < group.firstT) Object.assign(group, { first: r.time, firstT: t });
      if (t > group.lastT) Object.assign(group, { last: r.time, lastT: t });
    }
    return [...groups.values()].sort((a, b) => b.lastT - a.lastT);
  }

  function drawRejections(stats) {
    if (!stats) {
      $("rejections-note").textContent = "";
      $("rejections").replaceChildren(emptyRow(6, "no data"));
      return;
    }
    const all = stats.rejections || [];
    const groups = groupRejections(all).slice(0, MAX_REJECTION_ROWS);
    $("rejections-note").textContent = all.length ? `the latest ${all.length}, by kind` : "";
    const rows = groups.map((r) => {
      const when = timeText(r.first) !== timeText(r.last)
        ? `${timeText(r.first)} – ${timeText(r.last)}`
        : timeText(r.last);
      return el(
        "tr",
        { "data-testid": "rejection-row" },
        el("td", { className: "time", text: when }),
        el("td", { text: r.tenant ?? "(no key)" }),
        el("td", { text: r.model ?? "—" }),
        el("td", {}, el("span", { className: `badge reason-${r.reason}`, text: r.reason })),
        el("td", { className: "num", text: r.status ?? "—" }),
        el("td", { className: "num", text: `× ${r.count}` }),
      );
    });
    $("rejections").replaceChildren(...(rows.length ? rows : [emptyRow(6, "none — every request got in")]));
  }

  function draw(data) {
    $("device").textContent = data.residency.device ? `device ${data.residency.device}` : "";
    drawBudget(data.residency);
    drawResident(data.residency);
    drawTraffic(data.stats);
    drawTenants(data.stats, data.usage);
    drawCosts(data.usage);
    drawBatches(data.stats);
    drawRejections(data.stats);
  }

  function setStatus(ok, text) {
    const status = $("status");
    status.hidden = false;
    status.className = `status ${ok ? "ok" : "down"}`;
    status.textContent = text;
  }

  // ---- screens and the poll loop ----

  function showLogin(message) {
    generation += 1;
    clearTimeout(timer);
    usageCache = { at: 0, value: null };
    sessionStorage.removeItem(KEY_STORAGE);
    $("board").hidden = true;
    $("logout").hidden = true;
    $("status").hidden = true;
    $("device").textContent = "";
    $("login").hidden = false;
    const error = $("login-error");
    error.hidden = !message;
    error.textContent = message || "";
    $("login-submit").disabled = false;
    $("api-key").value = "";
    $("api-key").focus();
  }

  function showBoard() {
    $("login").hidden = true;
    $("board").hidden = false;
    $("logout").hidden = false;
  }

  async function poll(mine) {
    const key = sessionStorage.getItem(KEY_STORAGE);
    if (!key) {
      showLogin("");
      return;
    }
    try {
      const data = await fetchAll(key);
      if (mine !== generation) return;
      draw(data);
      showBoard();
      setStatus(true, `live · ${new Date().toLocaleTimeString("en-GB", { hour12: false })}`);
    } catch (e) {
      if (mine !== generation) return;
      if (e instanceof AuthError) {
        const why = e.status === 403 ? "that key is not an admin key" : "that key was refused";
        showLogin(`${why} (${e.status}): ${e.message}`);
        return;
      }
      if ($("board").hidden) {
        showLogin(`cannot read the dashboard data: ${e.message}`);
        return;
      }
      setStatus(false, `cannot reach the server — retrying (${e.message})`);
    }
    if (mine === generation) timer = setTimeout(() => poll(mine), POLL_MS);
  }

  function start() {
    generation += 1;
    clearTimeout(timer);
    poll(generation);
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("login-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const key = $("api-key").value.trim();
      if (!key) return;
      sessionStorage.setItem(KEY_STORAGE, key);
      $("login-submit").disabled = true;
      $("login-error").hidden = true;
      start();
    });
    $("logout").addEventListener("click", () => showLogin(""));
    if (sessionStorage.getItem(KEY_STORAGE)) start();
    else showLogin("");
  });
})();
