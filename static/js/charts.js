/* Metric charts shared by the job page and the compare page.
 *
 * A Grid holds panels (one Plotly chart each) of series keyed by step, so a point sent
 * twice (socket and catch-up fetch) is stored once and late points land in order. Each
 * series is drawn twice: the raw line faint, the EMA-smoothed line on top. The x-axis
 * is the step or the seconds since the series' start. */
"use strict";

window.Charts = (() => {
  const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#be185d", "#4d7c0f"];

  /* Debiased exponential moving average (TensorBoard's smoothing). */
  function ema(values, weight) {
    const out = [];
    let last = 0;
    let debias = 1;
    for (const value of values) {
      last = last * weight + (1 - weight) * value;
      debias *= weight;
      out.push(weight > 0 ? last / (1 - debias) : value);
    }
    return out;
  }

  /* Which panel a metric goes to: outcome rates share one, policy and total loss share
   * one; every other metric (each reward function, KL, entropy, ...) has its own. */
  function panelFor(name) {
    if (name.startsWith("outcome/")) return "outcome rates";
    if (name === "loss/policy" || name === "loss/total") return "loss";
    return name;
  }

  class Grid {
    constructor(container, { smoothing = 0.6, xMode = "step", panelOf = panelFor } = {}) {
      this.container = container;
      this.smoothing = smoothing;
      this.xMode = xMode;
      this.panelOf = panelOf;
      this.panels = new Map(); // panel -> {div, series: Map(name -> Map(step -> {value, t}))}
      this.dirty = new Set();
      this.scheduled = false;
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
        this.insertSorted(div, key);
        entry = { div, series: new Map() };
        this.panels.set(key, entry);
      }
      if (!entry.series.has(name)) entry.series.set(name, new Map());
      entry.series.get(name).set(step, { value, t: seconds });
      this.dirty.add(key);
      this.schedule();
    }

    insertSorted(div, key) {
      const rank = (k) => (k.startsWith("reward/mean") ? "0" : k.startsWith("reward/") ? "1" : k === "outcome rates" ? "2" : "3") + k;
      const next = [...this.container.children].find((child) => child.dataset.panel && rank(child.dataset.panel) > rank(key));
      this.container.insertBefore(div, next || null);
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
      let index = 0;
      for (const [name, points] of series) {
        const steps = [...points.keys()].sort((a, b) => a - b);
        const x = steps.map((s) => (this.xMode === "time" ? points.get(s).t : s));
        const y = steps.map((s) => points.get(s).value);
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
        showlegend: series.size > 1,
        legend: { orientation: "h", y: -0.25, font: { size: 10 } },
        paper_bgcolor: "rgba(0,0,0,0)",
        plot_bgcolor: "rgba(0,0,0,0)",
      };
      Plotly.react(div, traces, layout, { displaylogo: false, responsive: true });
    }
  }

  function bindControls(grid, { slider, output, axis }) {
    if (slider) {
      slider.addEventListener("input", () => {
        if (output) output.textContent = slider.value;
        grid.setSmoothing(parseFloat(slider.value));
      });
    }
    if (axis) axis.addEventListener("change", () => grid.setXMode(axis.value));
  }

  return { Grid, ema, panelFor, bindControls };
})();
