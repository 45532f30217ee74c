/* KVGate admin dashboard (GET /admin). Plain JavaScript, no dependencies, no request to any
 * other host: every figure comes from GET /admin/metrics on this server, polled every 2 s with
 * the admin key the user typed (kept in this tab's sessionStorage only). Everything inserted
 * into the page goes through textContent or SVG attributes, never innerHTML.
 *
 * window.kvgateDashboard exposes what the charts draw (history) and the last snapshot, for the
 * browser console and for tests/app/test_dashboard.py.
 */
"use strict";

(function () {
  const POLL_MS = 2000;
  const AUDIT_EVERY = 5;     // GET /admin/audit every 5th poll (10 s), and every poll while one runs
  const WINDOW_MS = 30000;   // hit rates and TTFT quantiles: over the last 30 s of samples
  const SPAN_MS = 300000;    // the charts show the last 5 minutes
  const KEY_STORAGE = "kvgate.adminKey";
  // Tiers are whatever the engine reports (m.tiers: the attached ones, top down, each with its
  // declared traits; m.tier_kinds: every kind it can attach), never a list fixed here.
  const PALETTE = ["#16a34a", "#d97706", "#9333ea", "#0d9488", "#be185d", "#4d7c0f", "#7c3aed"];
  const COLORS = {all: "#64748b", device: "#2563eb", p50: "#0891b2", p99: "#dc2626"};
  function colorOf(name) {
    if (!COLORS[name]) COLORS[name] = PALETTE[(Object.keys(COLORS).length - 4) % PALETTE.length];
    return COLORS[name];
  }
  // The attached tiers of a snapshot, top down.
  function attachedTiers(m) {
    const tiers = obj(m.tiers);
    return Object.keys(tiers).filter((name) => obj(tiers[name]).traits !== undefined);
  }
  // The device pool, the attached tiers, then the kinds that could be attached and are not.
  function tierNames(m) {
    const attached = attachedTiers(m);
    const kinds = Array.isArray(m.tier_kinds) ? m.tier_kinds : [];
    return ["device", ...attached, ...kinds.filter((k) => !attached.includes(k))];
  }
  const SHARE_COLORS = {
    queue: "#94a3b8", metadata: "#9333ea", tier_load: "#d97706", prefill: "#2563eb", first_decode: "#16a34a",
  };
  const SVG_NS = "http://www.w3.org/2000/svg";

  const state = {
    history: [],        // [{t, counters, ttftHist, hit: {tier: rate|null}, ttft: {p50, p99}}], oldest first
    latest: null,       // the last /admin/metrics body
    audit: null,        // the last GET /admin/audit body: {running, last: report | null}
    status: "starting", // starting | ok | unauthorized | unreachable | error
    error: null,        // {status, message} of the last failed poll
    polls: 0,
    timer: null,
    inflight: false,
    pending: false,
  };
  window.kvgateDashboard = state;

  // ---- small helpers ------------------------------------------------------------------------
  const $ = (id) => document.getElementById(id);

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function svgEl(tag, attrs) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    return node;
  }

  function clear(node) {
    while (node.firstChild) node.removeChild(node.firstChild);
  }

  const isNum = (x) => typeof x === "number" && Number.isFinite(x);
  const obj = (x) => (x && typeof x === "object" && !Array.isArray(x) ? x : {});

  function fmtInt(n) {
    return isNum(n) ? Math.round(n).toLocaleString("en-US") : "–";
  }

  function fmtPct(x) {
    if (!isNum(x)) return "–";
    const p = x * 100;
    return (p > 0 && p < 10 ? p.toFixed(1) : p.toFixed(0)) + "%";
  }

  function fmtSeconds(s) {
    if (!isNum(s)) return "–";
    if (s === 0) return "0";
    if (s < 1e-3) return (s * 1e6).toFixed(0) + " µs";
    if (s < 1) {
      const ms = s * 1e3;
      return (ms < 10 ? ms.toFixed(2) : ms < 100 ? ms.toFixed(1) : ms.toFixed(0)) + " ms";
    }
    return s.toFixed(s < 10 ? 2 : 1) + " s";
  }

  // An axis label: at most two decimals, trailing zeros dropped.
  function fmtTick(s) {
    if (s === 0) return "0";
    if (s < 1e-3) return parseFloat((s * 1e6).toFixed(1)) + " µs";
    if (s < 1) return parseFloat((s * 1e3).toFixed(2)) + " ms";
    return parseFloat(s.toFixed(2)) + " s";
  }

  function fmtNum(x, digits) {
    if (!isNum(x)) return "–";
    return x.toLocaleString("en-US", {maximumFractionDigits: digits === undefined ? 1 : digits});
  }

  function fmtBytes(n) {
    if (!isNum(n)) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
    return (i === 0 ? n.toFixed(0) : n.toFixed(n < 10 ? 1 : 0)) + " " + units[i];
  }

  // The q-quantile of a fixed-bucket histogram, interpolated inside its bucket (as the server's
  // cache/telemetry.py and Prometheus' histogram_quantile do). counts has one more entry than
  // bounds: the values above the last bound.
  function quantile(bounds, counts, q) {
    let total = 0;
    for (const n of counts) total += n;
    if (!total) return null;
    const rank = q * total;
    let seen = 0;
    for (let i = 0; i < counts.length; i += 1) {
      const n = counts[i];
      if (n && seen + n >= rank) {
        if (i >= bounds.length) return bounds[bounds.length - 1];
        const lo = i ? bounds[i - 1] : 0;
        return lo + (bounds[i] - lo) * Math.max(0, rank - seen) / n;
      }
      seen += n;
    }
    return bounds[bounds.length - 1];
  }

  // ---- the admin key --------------------------------------------------------------------------
  function storedKey() {
    try { return window.sessionStorage.getItem(KEY_STORAGE) || ""; } catch (_) { return ""; }
  }

  function storeKey(key) {
    try {
      if (key) window.sessionStorage.setItem(KEY_STORAGE, key);
      else window.sessionStorage.removeItem(KEY_STORAGE);
    } catch (_) { /* storage disabled: the key lives in the input field only */ }
  }

  function currentKey() {
    return ($("admin-key").value || "").trim();
  }

  // ---- alerts and status ----------------------------------------------------------------------
  function showAlert(message, kind) {
    const box = $("alert");
    box.textContent = message;
    box.className = "alert" + (kind === "warn" ? " warn" : "");
    box.dataset.kind = kind || "error";
    box.hidden = false;
  }

  function hideAlert() {
    const box = $("alert");
    box.hidden = true;
    box.textContent = "";
    box.dataset.kind = "";
  }

  function setStale(stale) {
    document.body.classList.toggle("stale", stale);
  }

  function setPill(text, kind) {
    const pill = $("ready-pill");
    pill.textContent = text;
    pill.className = "pill" + (kind ? " " + kind : "");
  }

  // ---- polling --------------------------------------------------------------------------------
  function schedule() {
    if (state.timer === null) state.timer = window.setTimeout(poll, POLL_MS);
  }

  function pollNow() {
    if (state.timer !== null) { window.clearTimeout(state.timer); state.timer = null; }
    if (state.inflight) state.pending = true;
    else poll();
  }

  async function errorMessage(response) {
    try {
      const body = await response.json();
      const message = obj(obj(body).error).message;
      if (typeof message === "string" && message) return message;
    } catch (_) { /* not JSON */ }
    return response.statusText || "no message";
  }

  async function poll() {
    state.timer = null;
    state.inflight = true;
    let keepPolling = true;
    const key = currentKey();
    try {
      if (/[^\x21-\x7e]/.test(key)) {
        state.status = "unauthorized";
        state.error = {status: 0, message: "invalid characters"};
        showAlert("The admin key contains characters an HTTP header cannot carry: check it and press “Use key”.");
        setPill("key needed", "bad");
        setStale(true);
        keepPolling = false;
        return;
      }
      const headers = {"Accept": "application/json"};
      if (key) headers.Authorization = "Bearer " + key;
      let response;
      try {
        response = await fetch("/admin/metrics", {headers, cache: "no-store", credentials: "omit"});
      } catch (err) {
        state.status = "unreachable";
        state.error = {status: 0, message: String(err && err.message || err)};
        showAlert("Cannot reach the KVGate server (" + state.error.message + "); retrying every 2 s.", "warn");
        setPill("unreachable", "bad");
        setStale(true);
        return;
      }
      if (response.status === 401 || response.status === 403) {
        const message = await errorMessage(response);
        state.status = "unauthorized";
        state.error = {status: response.status, message};
        showAlert(key
          ? "The admin key was refused (HTTP " + response.status + "): " + message + " Enter the right key and press “Use key”."
          : "This server needs the admin key (HTTP " + response.status + "): enter it above and press “Use key”.");
        setPill(key ? "key refused" : "key needed", "bad");
        setStale(true);
        keepPolling = false;  // until the user gives another key: no 401 every 2 s in the logs
        return;
      }
      if (!response.ok) {
        const message = await errorMessage(response);
        state.status = "error";
        state.error = {status: response.status, message};
        showAlert("GET /admin/metrics answered HTTP " + response.status + ": " + message + " (retrying every 2 s)", "warn");
        setStale(true);
        return;
      }
      const metrics = await response.json();
      state.status = "ok";
      state.error = null;
      state.polls += 1;
      hideAlert();
      setStale(false);
      ingest(metrics, Date.now());
      render();
      if (state.polls % AUDIT_EVERY === 1 || obj(state.audit).running) await pollAudit(headers);
    } catch (err) {
      state.status = "error";
      state.error = {status: 0, message: String(err && err.message || err)};
      showAlert("The dashboard failed to show the metrics: " + state.error.message, "warn");
      if (window.console) window.console.error(err);
    } finally {
      state.inflight = false;
      if (state.pending) {
        state.pending = false;
        poll();
      } else if (keepPolling) {
        schedule();
      }
    }
  }

  // The isolation audit's last report: shown as it is; a failed fetch leaves the panel as it was.
  async function pollAudit(headers) {
    try {
      const response = await fetch("/admin/audit", {headers, cache: "no-store", credentials: "omit"});
      if (!response.ok) return;
      state.audit = await response.json();
      renderAudit(state.audit);
    } catch (_) { /* the metrics poll reports connection trouble */ }
  }

  // ---- turning snapshots into time series -----------------------------------------------------
  // Cumulative token counters of one snapshot. Every prompt token the prefix cache found came
  // from exactly one tier: the device pool, or a lower tier it was loaded from. Blocks loaded
  // from a store pass through the memory tier (prefetch), so the memory tier's own part is its
  // promotions less those. (A tier's hits/misses alone say little: the chain asks a store only
  // for blocks its index or an existence check says it holds.)
  function countersOf(m) {
    const num = (x) => (isNum(x) ? x : 0);
    const pc = obj(m.prefix_cache);
    const tiers = obj(m.tiers);
    const bs = num(m.block_size);
    const counters = {
      query: num(pc.query_tokens),
      hit: num(pc.hit_tokens),
      promoted: num(m.promoted_blocks) * bs,
    };
    const roles = {};
    for (const name of attachedTiers(m)) {
      counters[name] = num(obj(tiers[name]).hits) * bs;
      roles[name] = obj(obj(tiers[name]).traits).role;
    }
    return {counters, roles};
  }

  // The share of the prompt tokens looked up between two snapshots that each tier served.
  function tierShares(c, b, roles) {
    const d = (key) => (c[key] === undefined ? null : Math.max(0, c[key] - (b[key] || 0)));
    const query = d("query");
    const out = {all: null, device: null};
    if (!(query > 0)) return out;
    const share = (x) => Math.min(1, Math.max(0, x / query));
    const promoted = d("promoted");
    out.all = share(d("hit"));
    out.device = share(d("hit") - promoted);
    const names = Object.keys(roles);
    let loaded = 0;  // tokens the stores delivered (through the memory tier)
    for (const name of names) {
      if (roles[name] !== "memory") {
        out[name] = share(d(name));
        loaded += d(name) || 0;
      }
    }
    for (const name of names) {
      if (roles[name] === "memory") out[name] = share(promoted - loaded);
    }
    return out;
  }

  function restarted(prev, next) {
    return next.counters.query < prev.counters.query ||
      (prev.ttftHist && next.ttftHist && total(next.ttftHist.counts) < total(prev.ttftHist.counts));
  }

  function total(counts) {
    let n = 0;
    for (const c of counts) n += c;
    return n;
  }

  function ingest(m, now) {
    state.latest = m;
    const hist = obj(obj(m.requests).ttft_s);
    const counted = countersOf(m);
    const sample = {
      t: now,
      counters: counted.counters,
      roles: counted.roles,
      ttftHist: Array.isArray(hist.buckets) && Array.isArray(hist.counts)
        ? {buckets: hist.buckets.slice(), counts: hist.counts.slice()} : null,
      hit: {all: null, device: null},
      ttft: {p50: null, p99: null},
    };
    const history = state.history;
    if (history.length && restarted(history[history.length - 1], sample)) history.length = 0;
    while (history.length && history[0].t < now - SPAN_MS) history.shift();
    let base = null;  // the oldest sample inside the window
    for (const p of history) {
      if (now - p.t <= WINDOW_MS + POLL_MS / 2) { base = p; break; }
    }
    if (base) {
      sample.hit = tierShares(sample.counters, base.counters, sample.roles);
      const h = sample.ttftHist;
      const bh = base.ttftHist;
      if (h && bh && h.counts.length === bh.counts.length) {
        const delta = h.counts.map((n, i) => Math.max(0, n - bh.counts[i]));
        sample.ttft.p50 = quantile(h.buckets, delta, 0.5);
        sample.ttft.p99 = quantile(h.buckets, delta, 0.99);
      }
    }
    history.push(sample);
  }

  // ---- rendering ------------------------------------------------------------------------------
  function render() {
    const m = state.latest || {};
    renderSummary(m);
    renderArchetype(obj(m.archetype));
    renderTiers(m);
    renderHitChart();
    renderTtftChart();
    renderTenants(obj(obj(m.requests).tenants), obj(obj(obj(m.prefix_cache).quota).owners));
    renderStatuses(obj(obj(m.requests).by_status));
    renderFacts(m);
    renderCacheControl(obj(m.cache_control));
    renderGaps(obj(m.gaps));
    $("updated").textContent = "updated " + new Date().toLocaleTimeString("en-GB");
  }

  function renderSummary(m) {
    const engine = obj(m.engine);
    if (m.ready) setPill("ready", "ok");
    else if (engine.status === "restarting") setPill("engine restarting", "warn");
    else if (m.model === null || m.model === undefined) setPill("loading", "warn");
    else setPill(String(engine.status || "not ready"), "warn");
    $("model").textContent = m.model || "–";
    $("num-running").textContent = fmtInt(m.num_running);
    $("num-waiting").textContent = fmtInt(m.num_waiting);
    let generations = 0;
    for (const t of Object.values(obj(obj(m.requests).tenants))) generations += isNum(obj(t).requests) ? t.requests : 0;
    $("requests-total").textContent = fmtInt(generations);
    const pc = obj(m.prefix_cache);
    $("prefix-hits").textContent = pc.query_tokens ? fmtPct(pc.hit_tokens / pc.query_tokens) : "–";
  }

  function renderArchetype(a) {
    const axes = obj(a.axes);
    $("archetype-name").textContent = a.name || "–";
    $("archetype-reason").textContent = a.reason || (a.name ? "" : "the engine is not loaded yet");
    const list = (x) => (Array.isArray(x) ? x.join(" → ") : x ? String(x) : "–");
    $("axis-locality").textContent = list(axes.locality);
    const lifetime = obj(axes.lifetime);
    $("axis-lifetime").textContent = lifetime.longest ? lifetime.longest + " (longest-lived tier)" : "–";
    $("axis-ownership").textContent = axes.ownership || "–";
    $("axis-substrate").textContent = list(axes.substrate);
  }

  function pill(text, kind) {
    return el("span", "pill " + kind, text);
  }

  function tierLine(label, value) {
    const line = el("div", "tier-line");
    line.appendChild(el("span", "k", label + " "));
    line.appendChild(el("span", "v", value));
    return line;
  }

  function bar(parts) {
    const node = el("div", "bar");
    for (const [className, fraction] of parts) {
      const span = el("span", className);
      span.style.width = (Math.max(0, Math.min(1, fraction)) * 100).toFixed(2) + "%";
      node.appendChild(span);
    }
    return node;
  }

  function renderTiers(m) {
    const box = $("tier-diagram");
    clear(box);
    const view = obj(obj(m.archetype).tiers);
    const tiers = obj(m.tiers);
    const last = state.history.length ? state.history[state.history.length - 1] : null;
    tierNames(m).forEach((name, i) => {
      if (i) box.appendChild(el("div", "arrow", "→"));
      const v = obj(view[name]);
      const t = obj(tiers[name]);
      const present = name === "device" ? m.num_blocks !== undefined : v.enabled === true || tiers[name] !== undefined;
      const card = el("div", "tier");
      card.dataset.tier = name;
      card.style.setProperty("--tier-color", colorOf(name));
      const head = el("div", "tier-head");
      head.appendChild(el("span", "tier-name", name));
      let health;
      if (!present) {
        card.classList.add("absent");
        health = "absent";
        head.appendChild(pill(name === "device" ? "not loaded" : "not attached", "off"));
      } else if (v.healthy === false || (t.breaker && t.breaker !== "closed")) {
        card.classList.add("down");
        health = "down";
        head.appendChild(pill(t.breaker && t.breaker !== "closed" ? "breaker " + t.breaker : "down", "bad"));
      } else if (v.active === false) {
        health = "inert";
        head.appendChild(pill("inert", "warn"));
      } else {
        health = "healthy";
        head.appendChild(pill("healthy", "ok"));
      }
      card.dataset.health = health;
      card.appendChild(head);
      if (!present) {
        card.appendChild(el("div", "tier-sub", v.substrate ? v.substrate + " · " + (v.lifetime || "") : ""));
        card.appendChild(el("div", "tier-line", name === "device" ? "waiting for the engine" :
          "attach: POST /admin/tiers"));
        box.appendChild(card);
        return;
      }
      card.appendChild(el("div", "tier-sub", [v.substrate, v.lifetime, t.policy].filter(Boolean).join(" · ")));
      const rate = last ? last.hit[name] : null;
      if (name === "device") {
        const n = m.num_blocks || 0;
        const used = m.blocks_in_use || 0;
        const cached = m.cached_blocks || 0;
        card.appendChild(bar([["used", n ? used / n : 0], ["cached", n ? Math.max(0, cached - used) / n : 0]]));
        card.appendChild(tierLine("in use", fmtInt(used) + " · cached " + fmtInt(cached) + " / " + fmtInt(n) + " blocks"));
        const pc = obj(m.prefix_cache);
        card.appendChild(tierLine("pool", fmtBytes(m.kv_pool_bytes) + " · " + fmtInt(m.block_size) + " tokens/block"));
        card.appendChild(tierLine("prompt tokens", fmtInt(pc.query_tokens) + " · " +
          (pc.query_tokens ? fmtPct(pc.hit_tokens / pc.query_tokens) : "–") + " from cache"));
        card.appendChild(tierLine("served, last 30 s", fmtPct(rate)));
      } else {
        const cap = t.capacity_blocks;
        if (isNum(cap) && cap > 0) {
          card.appendChild(bar([["used", (t.blocks || 0) / cap]]));
          card.appendChild(tierLine("held", fmtInt(t.blocks) + " / " + fmtInt(cap) + " blocks"));
        } else {
          card.appendChild(bar([]));
          card.appendChild(tierLine("held", "no fixed capacity (expiry by " + (t.policy || "ttl").toUpperCase() + ")"));
        }
        card.appendChild(tierLine("hits", fmtInt(t.hits) + " · misses " + fmtInt(t.misses) + " · puts " + fmtInt(t.puts)));
        card.appendChild(tierLine("read", fmtBytes(t.bytes_read) + " · written " + fmtBytes(t.bytes_written)));
        if (t.shares_device_slab) {  // CPU: blocks move to and from the device pool by trading rows
          card.appendChild(tierLine("handed over", fmtInt(t.handovers) + " blocks to and from the device, nothing copied"));
        }
        const errors = (t.errors || 0) + (t.corrupt || 0);
        card.appendChild(tierLine("served, last 30 s", fmtPct(rate) + (errors ? " · errors " + fmtInt(errors) : "")));
      }
      box.appendChild(card);
    });
  }

  function legend(box, items) {
    clear(box);
    for (const [label, color, value, key] of items) {
      const item = el("span", "item");
      item.dataset.series = key || label;
      const swatch = el("span", "swatch");
      swatch.style.background = color;
      item.appendChild(swatch);
      item.appendChild(document.createTextNode(label));
      item.appendChild(el("span", "value", value));
      box.appendChild(item);
    }
  }

  function niceCeil(x) {
    if (!(x > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(x)));
    for (const m of [1, 2, 3, 4, 6, 8, 10]) if (m * p >= x * (1 + 1e-9)) return m * p;
    return 10 * p;
  }

  // A line chart of series [{name, color, points: [[t, value|null]]}] over the last SPAN_MS.
  // Nulls break the line; an isolated value is drawn as a dot.
  function drawChart(svg, series, yMax, yFormat, emptyNote) {
    clear(svg);
    const w = Math.max(200, Math.round(svg.clientWidth || svg.getBoundingClientRect().width || 500));
    const h = Math.max(100, Math.round(svg.clientHeight || 150));
    svg.setAttribute("viewBox", "0 0 " + w + " " + h);
    const left = 52, right = 10, top = 8, bottom = 18;
    const pw = w - left - right, ph = h - top - bottom;
    const now = Date.now();
    const x = (t) => left + (t - (now - SPAN_MS)) / SPAN_MS * pw;
    const y = (v) => top + ph - Math.min(1, v / yMax) * ph;
    for (let i = 0; i <= 4; i += 1) {
      const v = yMax * i / 4;
      svg.appendChild(svgEl("line", {x1: left, x2: left + pw, y1: y(v), y2: y(v), class: i ? "grid-line" : "axis"}));
      const label = svgEl("text", {x: left - 5, y: y(v) + 3, "text-anchor": "end"});
      label.textContent = yFormat(v);
      svg.appendChild(label);
    }
    for (let s = 0; s <= SPAN_MS / 1000; s += 60) {
      const label = svgEl("text", {x: x(now - s * 1000), y: h - 4, "text-anchor": s === 0 ? "end" : "middle"});
      label.textContent = s === 0 ? "now" : "−" + s / 60 + " min";
      svg.appendChild(label);
    }
    let drawn = 0;
    for (const {color, points, dashed} of series) {
      let run = [];
      const flush = () => {
        if (run.length === 1) {
          svg.appendChild(svgEl("circle", {cx: run[0][0], cy: run[0][1], r: 2.5, fill: color}));
        } else if (run.length > 1) {
          const d = run.map(([px, py], i) => (i ? "L" : "M") + px.toFixed(1) + " " + py.toFixed(1)).join(" ");
          const path = svgEl("path", {d, fill: "none", stroke: color, "stroke-width": dashed ? 1.5 : 2,
            "stroke-linejoin": "round", "stroke-linecap": "round"});
          if (dashed) path.setAttribute("stroke-dasharray", "4 3");
          svg.appendChild(path);
        }
        drawn += run.length;
        run = [];
      };
      for (const [t, v] of points) {
        if (isNum(v) && t >= now - SPAN_MS) run.push([x(t), y(v)]);
        else flush();
      }
      flush();
    }
    svg.dataset.points = String(drawn);
    if (!drawn) {
      const note = svgEl("text", {x: left + pw / 2, y: top + ph / 2, "text-anchor": "middle", class: "empty-note"});
      note.textContent = emptyNote;
      svg.appendChild(note);
    }
  }

  // A value of the newest sample ("–" in the legend when that window saw nothing).
  function latestValue(getter) {
    const h = state.history;
    return h.length ? getter(h[h.length - 1]) : null;
  }

  function renderHitChart() {
    const shown = ["device", ...attachedTiers(state.latest || {})];
    const series = ["all", ...shown].map((name) => ({
      name, color: colorOf(name), dashed: name === "all", points: state.history.map((p) => [p.t, p.hit[name]]),
    }));
    drawChart($("hit-chart"), series, 1, (v) => Math.round(v * 100) + "%",
      "no prompt lookups in the last 5 min: send some requests");
    legend($("hit-legend"), ["all", ...shown].map((name) => [name === "all" ? "all tiers" : name, colorOf(name),
      fmtPct(latestValue((p) => p.hit[name])), name]));
  }

  function renderTtftChart() {
    const series = ["p50", "p99"].map((q) => ({
      name: q, color: COLORS[q], points: state.history.map((p) => [p.t, p.ttft[q]]),
    }));
    let max = 0;
    for (const p of state.history) if (isNum(p.ttft.p99)) max = Math.max(max, p.ttft.p99);
    drawChart($("ttft-chart"), series, niceCeil(max || 0.001), fmtTick,
      "no completions in the last 5 min");
    const all = obj(obj((state.latest || {}).requests).ttft_s);
    legend($("ttft-legend"), [
      ["p50", COLORS.p50, fmtSeconds(latestValue((p) => p.ttft.p50))],
      ["p99", COLORS.p99, fmtSeconds(latestValue((p) => p.ttft.p99))],
      ["since start", "#cbd5e1", "p50 " + fmtSeconds(all.p50) + " · p99 " + fmtSeconds(all.p99) + " · " +
        fmtInt(all.count) + " requests", "all"],
    ]);
  }

  function renderTenants(tenants, owners) {
    const body = $("tenant-rows");
    clear(body);
    const names = Object.keys(tenants).sort();
    if (!names.length) {
      const row = el("tr");
      const cell = el("td", "empty", "no generation requests yet");
      cell.colSpan = 10;
      row.appendChild(cell);
      body.appendChild(row);
      return;
    }
    for (const name of names) {
      const t = obj(tenants[name]);
      const ttft = obj(t.ttft_s);
      const row = el("tr");
      row.dataset.tenant = name;
      row.appendChild(el("td", "", name === "-" ? "(no key: tenants off)" : name));
      for (const value of [fmtInt(t.requests), fmtInt(t.errors), fmtInt(t.prompt_tokens), fmtInt(t.cached_tokens),
        fmtPct(t.hit_rate), fmtInt(t.completion_tokens), fmtInt(owners[name] || 0), fmtSeconds(ttft.p50),
        fmtSeconds(ttft.p99)]) {
        row.appendChild(el("td", "num", value));
      }
      body.appendChild(row);
    }
  }

  function renderFacts(m) {
    const r = obj(m.requests);
    const engine = obj(m.engine);
    const tpot = obj(r.tpot_s), e2e = obj(r.e2e_s);
    const reasons = obj(m.preemptions_by_reason);
    const facts = [
      ["time per output token (TPOT)", "p50 " + fmtSeconds(tpot.p50) + " · p99 " + fmtSeconds(tpot.p99)],
      ["end to end", "p50 " + fmtSeconds(e2e.p50) + " · p99 " + fmtSeconds(e2e.p99)],
      ["HTTP requests in flight", fmtInt(r.requests_in_flight)],
      ["client disconnects", fmtInt(r.client_disconnects)],
      ["tokens generated", fmtInt(m.generated_tokens)],
      ["prompt tokens computed / reused", fmtInt(m.computed_tokens) + " / " + fmtInt(m.reused_tokens)],
      ["preemptions", fmtInt(m.preemptions) + (Object.keys(reasons).length ? " (" + Object.entries(reasons)
        .map(([k, v]) => k + " " + fmtInt(v)).join(", ") + ")" : "")],
      ["engine", [engine.mode, engine.status].filter(Boolean).join(", ") +
        (isNum(engine.restarts) ? " · " + fmtInt(engine.restarts) + " restarts" : "")],
    ];
    const box = $("engine-facts");
    clear(box);
    for (const [label, value] of facts) {
      const row = el("div");
      row.appendChild(el("dt", "", label));
      row.appendChild(el("dd", "", value || "–"));
      box.appendChild(row);
    }
  }

  function perKey(counts) {
    const entries = Object.entries(obj(counts));
    return entries.length ? entries.map(([k, v]) => k + " " + fmtInt(v)).join(" · ") : "none";
  }

  function renderCacheControl(c) {
    const box = $("cache-facts");
    clear(box);
    if (!Object.keys(c).length) {
      box.appendChild(el("div", "empty", "no data yet"));
      return;
    }
    const requests = obj(c.requests);
    const facts = [
      ["pinned blocks, where they are now", perKey(c.pinned_blocks)],
      ["pins / prefetch protections", fmtInt(c.pinned_keys) + " / " + fmtInt(c.protected_keys) +
        (isNum(c.pin_limit) ? " (at most " + fmtInt(c.pin_limit) + " in all)" : "")],
      ["held per tenant", perKey(c.held_by_tenant)],
      ["requests", ["lookup", "prefetch", "pin", "unpin", "delete"]
        .map((op) => op + " " + fmtInt(requests[op] || 0)).join(" · ")],
      ["prefetched blocks, by source", perKey(c.prefetched_blocks) +
        (c.prefetches_in_flight ? " (" + fmtInt(c.prefetches_in_flight) + " in flight)" : "")],
      ["expired protections", fmtInt(c.expired_protections)],
      ["dropped blocks, by tier", perKey(c.dropped_blocks) +
        (c.skipped_in_use ? " (" + fmtInt(c.skipped_in_use) + " in use, skipped)" : "")],
    ];
    for (const [label, value] of facts) {
      const row = el("div");
      row.appendChild(el("dt", "", label));
      row.appendChild(el("dd", "", value || "–"));
      box.appendChild(row);
    }
  }

  function renderStatuses(byStatus) {
    const box = $("status-chips");
    clear(box);
    const codes = Object.keys(byStatus).sort();
    if (!codes.length) return;
    box.appendChild(el("span", "k", "HTTP responses, all routes:"));
    for (const code of codes) {
      box.appendChild(el("span", "chip s" + String(code).charAt(0), code + " × " + fmtInt(byStatus[code])));
    }
  }

  function ago(unixSeconds) {
    const s = Math.max(0, Date.now() / 1000 - unixSeconds);
    if (s < 90) return Math.round(s) + " s ago";
    if (s < 5400) return Math.round(s / 60) + " min ago";
    if (s < 172800) return Math.round(s / 3600) + " h ago";
    return Math.round(s / 86400) + " days ago";
  }

  function fmtP(p) {
    return isNum(p) ? (p !== 0 && p < 1e-3 ? p.toExponential(1) : p.toFixed(3)) : "–";
  }

  function renderAudit(status) {
    const head = $("audit-head"), tiers = $("audit-tiers"), failures = $("audit-failures");
    clear(head); clear(tiers); clear(failures);
    const s = obj(status), r = obj(s.last);
    if (s.running) head.appendChild(pill("running…", "warn"));
    if (!s.last) {
      if (!s.running) {
        head.appendChild(pill("no audit since the server started", "off"));
        head.appendChild(el("span", "k", "run one: POST /admin/audit with the admin key (docs/audit.md)"));
      }
      return;
    }
    head.appendChild(pill(r.passed ? "passed" : "FAILED", r.passed ? "ok" : "bad"));
    const when = new Date(r.started_at * 1000);
    const facts = [["at", when.toLocaleString("en-GB") + " (" + ago(r.started_at) + ")"],
      ["took", fmtSeconds(r.duration_s)], ["requests", fmtInt(r.requests)], ["samples", fmtInt(r.samples)]];
    const control = obj(r.control);
    if (r.control) facts.push(["timing control", (control.passed ? "sees the cache" : "blind") + ", p " + fmtP(control.p)]);
    const cleanup = obj(r.cleanup);
    facts.push(["left behind", cleanup.remaining_tokens === 0 ? "nothing" : isNum(cleanup.remaining_tokens)
      ? fmtInt(cleanup.remaining_tokens) + " tokens" : "unknown"]);
    for (const [k, v] of facts) {
      const span = el("span");
      span.appendChild(el("span", "k", k + " "));
      span.appendChild(el("span", "", v));
      head.appendChild(span);
    }
    for (const [name, t] of Object.entries(obj(r.tiers))) {
      const box = el("div", "audit-tier " + (t.passed ? "ok" : "bad"));
      box.dataset.tier = name;
      box.appendChild(el("span", "tier-name", name));
      box.appendChild(pill(t.passed ? "pass" : "FAIL", t.passed ? "ok" : "bad"));
      box.appendChild(el("div", "", "same salt " + fmtInt(t.same_salt_hit_tokens) + " / " + fmtInt(t.expected_tokens) +
        " tokens · other salt " + fmtInt(t.other_salt_hit_tokens)));
      const ks = obj(t.ks);
      if (t.ks) box.appendChild(el("div", "", "timing KS D " + fmtNum(ks.d, 3) + ", p " + fmtP(ks.p)));
      tiers.appendChild(box);
      for (const why of Array.isArray(t.failures) ? t.failures : []) failures.appendChild(el("li", "", name + ": " + why));
    }
    if (control.passed === false) failures.appendChild(el("li", "", "the timing control saw no difference between " +
      "hits and misses: the timing checks prove nothing"));
    if (r.error) failures.appendChild(el("li", "", "stopped early: " + r.error));
  }

  // The seven gaps of docs/metrics.md: [key, title, meaning, value(gap) → string | Node]
  const GAPS = [
    ["remote_access", "Remote access",
      "Blocks per Redis pipeline op and the read/write mix: few large batches, or many small ones?",
      (g) => {
        if (g.attached === false) return null;
        const ops = obj(g.ops), blocks = obj(g.blocks);
        const parts = Object.keys(ops).sort().map((op) =>
          op + " " + fmtInt(ops[op]) + " × " + fmtNum(ops[op] ? blocks[op] / ops[op] : null));
        return (parts.length ? "ops × blocks/op: " + parts.join(" · ") : "no remote ops yet") +
          (isNum(g.read_share) ? " · " + fmtPct(g.read_share) + " reads" : "");
      }],
    ["metadata", "Metadata cost",
      "Time hashing and looking up a request's blocks (share of its TTFT); bytes describing blocks per byte moved.",
      (g) => {
        const per = obj(g.per_request_s), share = obj(g.share_of_ttft);
        if (!per.count) return null;
        return "p50 " + fmtSeconds(per.p50) + " / request · " + fmtPct(share.p50) + " of TTFT (p50)" +
          (isNum(g.bytes_ratio) ? " · " + fmtNum(g.bytes_ratio, 4) + " B per data B" : "");
      }],
    ["completion_overhead", "Completion overhead",
      "Tier ops' issue-to-done time vs the transfer itself: the share lost to thread hops, queueing, polling.",
      (g) => {
        const parts = Object.keys(g).sort().filter((op) => obj(g[op]).ops > 0).map((op) =>
          op + " " + fmtPct(g[op].overhead_share) + " (" + fmtInt(g[op].ops) + ")");
        return parts.length ? "overhead (ops): " + parts.join(" · ") : null;
      }],
    ["block_life", "Reuse & lifetime",
      "Accesses and time between two uses of a block per tier: a tier holding more blocks than that keeps it.",
      (g) => {
        const parts = Object.keys(g).filter((name) => obj(obj(g[name]).reuse_distance).count > 0).map((name) => {
          const life = obj(g[name]);
          return name + " " + fmtNum(life.reuse_distance.p50, 0) + " / " + fmtSeconds(obj(life.reuse_interval_s).p50);
        });
        return parts.length ? "p50 distance / interval: " + parts.join(" · ") : null;
      }],
    ["prefetch_slack", "Prefetch slack",
      "From knowing a request's blocks to first needing them: loads shorter than this could be hidden.",
      (g) => {
        const slack = obj(g.slack_s);
        if (!slack.count) return null;
        return "p50 " + fmtSeconds(slack.p50) + ", p99 " + fmtSeconds(slack.p99) + " · " + fmtInt(g.loads_within_slack) +
          " of " + fmtInt(g.loads) + " loads fit in it";
      }],
    ["ttft_attribution", "P99 TTFT parts",
      "What the requests at or above the P99 engine TTFT spent it on (the parts add up to the TTFT).",
      (g) => {
        const shares = obj(g.shares);
        if (!g.samples || !Object.keys(shares).length) return null;
        const node = el("div");
        const strip = el("div", "shares");
        const order = Object.keys(shares).sort((a, b) => shares[b] - shares[a]);
        for (const part of order) {
          const span = el("span");
          span.style.width = (Math.max(0, shares[part]) * 100).toFixed(2) + "%";
          span.style.background = SHARE_COLORS[part] || "#64748b";
          span.title = part + " " + fmtPct(shares[part]);
          strip.appendChild(span);
        }
        node.appendChild(el("div", "", "P99 " + fmtSeconds(g.ttft_s) + " (" + fmtInt(g.tail_requests) + " of " +
          fmtInt(g.samples) + " requests): " + order.filter((p) => shares[p] > 0.005)
          .map((p) => p + " " + fmtPct(shares[p])).join(" · ")));
        node.appendChild(strip);
        return node;
      }],
    ["traces", "Public traces",
      "Requests held in the trace ring, exported in the Mooncake layout at GET /admin/trace.",
      (g) => (isNum(g.recorded) ? fmtInt(g.recorded) + (isNum(g.capacity) ? " of " + fmtInt(g.capacity) : "") +
        " requests recorded · " + (g.export || "/admin/trace") : null)],
  ];

  function renderGaps(gaps) {
    const list = $("gap-list");
    clear(list);
    GAPS.forEach(([key, title, meaning, value], i) => {
      const item = el("li", "gap");
      item.dataset.gap = key;
      item.appendChild(el("span", "gap-n", i + 1));
      item.appendChild(el("span", "gap-title", title));
      let shown = null;
      if (gaps[key] !== undefined) {
        try { shown = value(obj(gaps[key])); } catch (_) { shown = null; }
      }
      if (key === "remote_access" && obj(gaps[key]).attached === false) shown = "remote tier not attached";
      const cell = el("span", "gap-value" + (shown === null ? " none" : ""));
      if (shown instanceof Node) cell.appendChild(shown);
      else cell.textContent = shown === null ? "no data yet" : shown;
      item.appendChild(cell);
      item.appendChild(el("span", "gap-meaning", meaning));
      list.appendChild(item);
    });
  }

  // ---- start ----------------------------------------------------------------------------------
  function start() {
    const input = $("admin-key");
    input.value = storedKey();
    $("key-form").addEventListener("submit", (event) => {
      event.preventDefault();
      storeKey(currentKey());
      hideAlert();
      setPill("connecting…", "");
      pollNow();
    });
    $("key-forget").addEventListener("click", () => {
      input.value = "";
      storeKey("");
      pollNow();
    });
    window.addEventListener("resize", () => { if (state.latest) { renderHitChart(); renderTtftChart(); } });
    renderGaps({});
    $("tier-diagram").appendChild(el("div", "tier-line", "waiting for GET /admin/metrics…"));
    renderHitChart();
    renderTtftChart();
    poll();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
