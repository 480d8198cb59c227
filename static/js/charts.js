/* Metric charts shared by the job page and the compare page.
 *
 * A Grid holds panels (one Plotly chart each) of series keyed by step, so a point sent
 * twice (socket and catch-up fetch) is stored once and late points land in order. Each
 * series is drawn twice: the raw line faint, the EMA-smoothed line on top. The x-axis
 * is the step or the seconds since the series' start. With `sections`, panels are grouped
 * by namespace (the part of a metric's name before "/") in collapsible sections, the
 * outcomes and rewards first; a search box hides panels whose metrics do not match, and
 * which sections are closed is remembered per `layoutKey` (e.g. per job kind). */
"use strict";

window.Charts = (() => {
  const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#be185d", "#4d7c0f"];

  /* Debiased exponential moving average (TensorBoard's smoothing). Rounding can carry an
   * average a hair outside the values it averages (1.0000000000000002 from ones), which
   * would invent variance: every smoothed point stays within the raw values so far. */
  function ema(values, weight) {
    const out = [];
    let last = 0;
    let debias = 1;
    let low = Infinity;
    let high = -Infinity;
    for (const value of values) {
      last = last * weight + (1 - weight) * value;
      debias *= weight;
      low = Math.min(low, value);
      high = Math.max(high, value);
      const smoothed = weight > 0 ? last / (1 - debias) : value;
      out.push(Math.min(high, Math.max(low, smoothed)));
    }
    return out;
  }

  /* An explicit y range for a flat series, so Plotly draws a flat line with readable
   * ticks instead of zooming into a 1e-16 band; null (autorange) otherwise. */
  function flatRange(values) {
    if (!values.length) return null;
    const low = Math.min(...values);
    const high = Math.max(...values);
    if (high - low > 1e-9 * Math.max(1, Math.abs(high))) return null;
    const pad = Math.max(Math.abs(high) * 0.1, 0.1);
    return [low - pad, high + pad];
  }

  const SECTION_ORDER = ["outcome", "reward", "loss", "policy", "advantage", "optim", "perf", "length"];

  /* The section a panel belongs to: its metric namespace ("reward/win" -> reward). */
  function sectionOf(panel) {
    if (panel === "outcome rates") return "outcome";
    return panel.includes("/") ? panel.split("/")[0] : panel;
  }

  /* Which panel a metric goes to: outcome rates share one, policy and total loss share
   * one; every other metric (each reward function, KL, entropy, ...) has its own. */
  function panelFor(name) {
    if (name.startsWith("outcome/")) return "outcome rates";
    if (name === "loss/policy" || name === "loss/total") return "loss";
    return name;
  }

  class Grid {
    constructor(container, { smoothing = 0.6, xMode = "step", panelOf = panelFor, sections = false, layoutKey = null } = {}) {
      this.container = container;
      this.smoothing = smoothing;
      this.xMode = xMode;
      this.panelOf = panelOf;
      this.sections = sections ? new Map() : null; // name -> {details, body, count}
      this.layoutKey = layoutKey ? `rllab.charts.${layoutKey}` : null;
      this.closed = new Set(this.layoutKey ? JSON.parse(localStorage.getItem(this.layoutKey) || "[]") : []);
      this.query = "";
      this.panels = new Map(); // panel -> {div, series: Map(name -> Map(step -> {value, t}))}
      this.dirty = new Set();
      this.scheduled = false;
    }

    /* The element a panel's chart goes into: its section's body, made on first use. */
    home(key) {
      if (!this.sections) return this.container;
      const name = sectionOf(key);
      let section = this.sections.get(name);
      if (!section) {
        const details = document.createElement("details");
        details.className = "chart-section";
        details.dataset.section = name;
        details.open = !this.closed.has(name);
        const summary = document.createElement("summary");
        summary.textContent = name;
        const body = document.createElement("div");
        body.className = "charts";
        details.append(summary, body);
        details.addEventListener("toggle", () => {
          if (details.open) this.closed.delete(name);
          else this.closed.add(name);
          if (this.layoutKey) localStorage.setItem(this.layoutKey, JSON.stringify([...this.closed]));
          if (details.open) this.redrawAll(); // charts drawn while hidden have no width
        });
        const rank = (n) => (SECTION_ORDER.includes(n) ? SECTION_ORDER.indexOf(n) : SECTION_ORDER.length) + ":" + n;
        const next = [...this.container.children].find((child) => child.dataset.section && rank(child.dataset.section) > rank(name));
        this.container.insertBefore(details, next || null);
        section = { details, body, summary };
        this.sections.set(name, section);
      }
      return section.body;
    }

    /* Show only the panels with a metric whose name contains `query`. */
    filter(query) {
      this.query = query.trim().toLowerCase();
      for (const [key, entry] of this.panels) this.applyFilter(key, entry);
      if (this.sections) {
        for (const { details, body } of this.sections.values()) {
          details.hidden = ![...body.children].some((child) => !child.hidden);
        }
      }
    }

    applyFilter(key, entry) {
      const names = [key, ...entry.series.keys()].map((n) => n.toLowerCase());
      entry.div.hidden = Boolean(this.query) && !names.some((n) => n.includes(this.query));
    }

    add(name, step, value, seconds, panel = null) {
      const key = panel || this.panelOf(name);
      let entry = this.panels.get(key);
      if (!entry) {
        const empty = this.container.querySelector(".empty");
        if (empty) empty.remove();
        const div = document.createElement("div");
        div.className = "chart";
        div.dataset.panel = key;
        div.dataset.testid = "chart";
        this.insertSorted(div, key, this.home(key));
        entry = { div, series: new Map() };
        this.panels.set(key, entry);
        this.applyFilter(key, entry);
        if (this.sections) this.filter(this.query);
      }
      if (!entry.series.has(name)) entry.series.set(name, new Map());
      entry.series.get(name).set(step, { value, t: seconds });
      this.dirty.add(key);
      this.schedule();
    }

    insertSorted(div, key, parent) {
      const rank = (k) => (k.startsWith("reward/mean") ? "0" : k.startsWith("reward/") ? "1" : k === "outcome rates" ? "2" : "3") + k;
      const next = [...parent.children].find((child) => child.dataset.panel && rank(child.dataset.panel) > rank(key));
      parent.insertBefore(div, next || null);
    }

    setSmoothing(weight) {
      this.smoothing = weight;
      this.redrawAll();
    }

    setXMode(mode) {
      this.xMode = mode;
      this.redrawAll();
    }

    redrawAll() {
      for (const key of this.panels.keys()) this.dirty.add(key);
      this.schedule();
    }

    schedule() {
      if (this.scheduled) return;
      this.scheduled = true;
      requestAnimationFrame(() => {
        this.scheduled = false;
        for (const key of this.dirty) this.draw(key);
        this.dirty.clear();
      });
    }

    draw(key) {
      const { div, series } = this.panels.get(key);
      const traces = [];
      const every = [];
      let index = 0;
      for (const [name, points] of series) {
        const steps = [...points.keys()].sort((a, b) => a - b);
        const x = steps.map((s) => (this.xMode === "time" ? points.get(s).t : s));
        const y = steps.map((s) => points.get(s).value);
        every.push(...y);
        const color = COLORS[index % COLORS.length];
        const label = name.startsWith("outcome/") ? name.slice(8) : name;
        traces.push({ x, y, mode: "lines", name: label + " (raw)", line: { color, width: 1 }, opacity: 0.25, showlegend: false, hoverinfo: "skip" });
        traces.push({ x, y: ema(y, this.smoothing), mode: y.length > 1 ? "lines" : "markers", name: label, line: { color, width: 2 }, marker: { color } });
        index += 1;
      }
      const layout = {
        title: { text: key, font: { size: 13 } },
        margin: { l: 45, r: 10, t: 30, b: 35 },
        height: 240,
        xaxis: { title: { text: this.xMode === "time" ? "seconds" : "step", font: { size: 11 } } },
        yaxis: flatRange(every) ? { range: flatRange(every), autorange: false } : { autorange: true },
        showlegend: series.size > 1,
        legend: { orientation: "h", y: -0.25, font: { size: 10 } },
        paper_bgcolor: "rgba(0,0,0,0)",
        plot_bgcolor: "rgba(0,0,0,0)",
      };
      Plotly.react(div, traces, layout, { displaylogo: false, responsive: true });
    }
  }

  function bindControls(grid, { slider, output, axis, search }) {
    if (search) search.addEventListener("input", () => grid.filter(search.value));
    if (slider) {
      slider.addEventListener("input", () => {
        if (output) output.textContent = slider.value;
        grid.setSmoothing(parseFloat(slider.value));
      });
    }
    if (axis) axis.addEventListener("change", () => grid.setXMode(axis.value));
  }

  return { Grid, ema, flatRange, panelFor, sectionOf, bindControls };
})();
