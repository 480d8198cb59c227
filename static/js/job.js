/* The live job page.
 *
 * The database is the source of truth and the websocket only a notification: on load
 * and after every (re)connect the page fetches everything after its step cursor from
 * the JSON API, then applies the per-step batches the worker pushes. A batch whose
 * `since_step` is past the cursor means messages were lost, so the page fetches again. */
"use strict";

(() => {
  const live = JSON.parse(document.getElementById("job-live").textContent);
  const $ = (id) => document.getElementById(id);
  const grid = new Charts.Grid($("metric-charts"), { sections: true, layoutKey: `job-${live.kind}` });
  Charts.bindControls(grid, { slider: $("ema"), output: $("ema-value"), axis: $("x-axis"), search: $("metric-search") });

  const TERMINAL = ["succeeded", "failed", "cancelled", "lost"];
  let cursor = null; // last step whose batch the page has
  let lastLogId = null;
  let status = live.status;
  let socket = null;
  let retryDelay = 1000;
  let fetching = null;
  const origin = () => live.started || live.created;
  const progressSamples = [];
  const shownRollouts = new Set();

  function addMetric(name, point) {
    grid.add(name, point.step, point.value, point.t - origin());
  }

  function setStatus(payload) {
    if (!payload) return;
    const before = status;
    status = payload.status;
    const el = $("job-status");
    el.dataset.status = status;
    const stopping = payload.cancel_requested && status === "running" ? " (stopping)" : "";
    el.innerHTML = `<span class="status status-${status}">${status}${stopping}</span>`;
    if (payload.worker) $("job-worker").textContent = payload.worker;
    const engine = $("job-engine");
    if (payload.engine_used && engine && payload.engine_used !== engine.dataset.engine) {
      // The engine a worker picked (it may differ from the one asked: vLLM missing there).
      engine.dataset.engine = payload.engine_used;
      const asked = engine.dataset.asked;
      engine.textContent = payload.engine_used;
      if (asked && asked !== payload.engine_used) {
        const note = document.createElement("small");
        note.className = "muted";
        note.textContent = ` (${asked} asked; see the log)`;
        engine.append(note);
      }
    }
    if (payload.error) {
      $("job-error").textContent = payload.error;
      $("job-error").hidden = false;
    }
    if (payload.progress) setProgress(payload.progress);
    $("cancel-form").hidden = TERMINAL.includes(status) || payload.cancel_requested;
    if (payload.last_step !== null && payload.last_step !== undefined) cursor = Math.max(cursor ?? payload.last_step, payload.last_step);
    if (TERMINAL.includes(status) && !TERMINAL.includes(before)) {
      $("live-state").textContent = `job ${status}; loading results…`;
      if (socket) socket.close(1000);
      // The summary and checkpoints are rendered by the server: reload once it is over.
      setTimeout(() => window.location.reload(), 800);
    }
  }

  function formatSeconds(seconds) {
    if (!isFinite(seconds)) return "?";
    const s = Math.round(seconds);
    if (s < 60) return `${s}s`;
    if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
    return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
  }

  /* The rate is measured over the last minute of progress and smoothed over time (a time
   * constant of RATE_SMOOTHING_SECONDS, not a share per message), so the ETA moves steadily:
   * a batch of rollouts that lands in several messages at once moves it once, a little. A
   * new phase of the job (another description, as an eval's baselines, or a count that
   * starts again) measures its rate afresh instead of waiting for the old one to age out. */
  const RATE_SMOOTHING_SECONDS = 10;
  let smoothedRate = null;
  let rateUpdated = null;
  let phase = null;
  function setProgress({ done, total, desc }) {
    const bar = $("progress");
    bar.value = total ? Math.min(1, done / total) : 0;
    bar.dataset.done = done;
    bar.dataset.total = total;
    $("progress-text").textContent = `${desc || ""} ${done}/${total}`.trim();
    const now = Date.now() / 1000;
    const last = progressSamples[progressSamples.length - 1];
    if (desc !== phase || (last && done < last[1])) {
      phase = desc;
      progressSamples.length = 0;
      smoothedRate = null;
      $("progress-rate").textContent = "";
    }
    progressSamples.push([now, done]);
    while (progressSamples.length > 2 && now - progressSamples[0][0] > 60) progressSamples.shift();
    const [t0, d0] = progressSamples[0];
    if (done >= total && total) {
      $("progress-rate").textContent = "";
    } else if (now - t0 > 0.5 && done > d0) {
      const rate = (done - d0) / (now - t0);
      const weight = smoothedRate === null ? 1 : 1 - Math.exp(-(now - rateUpdated) / RATE_SMOOTHING_SECONDS);
      smoothedRate = smoothedRate === null ? rate : smoothedRate + weight * (rate - smoothedRate);
      rateUpdated = now;
      $("progress-rate").textContent = `${smoothedRate.toFixed(2)}/s · ETA ${formatSeconds((total - done) / smoothedRate)}`;
    }
  }

  /* The duration ticks while the job runs (the server rendered it at page load). */
  function formatDuration(seconds) {
    const s = Math.max(0, Math.floor(seconds));
    const h = Math.floor(s / 3600);
    const m = Math.floor((s % 3600) / 60);
    const pad = (n) => String(n).padStart(2, "0");
    return h ? `${h}:${pad(m)}:${pad(s % 60)}` : `${m}:${pad(s % 60)}`;
  }
  setInterval(() => {
    if (status !== "running") return;
    live.started = live.started || Date.now() / 1000;
    $("job-duration").textContent = formatDuration(Date.now() / 1000 - live.started);
  }, 1000);

  function addRollouts(rows) {
    const feed = $("rollout-feed");
    for (const row of rows) {
      if (shownRollouts.has(row.id)) continue;
      shownRollouts.add(row.id);
      const li = document.createElement("li");
      li.dataset.rolloutId = row.id;
      li.dataset.step = row.step;
      const link = document.createElement("a");
      link.href = `${live.inspector}${row.id}/`;
      link.textContent = `step ${row.step} · example ${row.example_id}`;
      const outcome = document.createElement("span");
      outcome.className = `outcome outcome-${row.outcome || "none"}`;
      outcome.textContent = row.outcome || "–";
      const reward = document.createElement("span");
      reward.className = "reward";
      reward.textContent = Number(row.reward).toFixed(3);
      li.append(link, " ", outcome, " ", reward);
      feed.prepend(li);
    }
    while (feed.children.length > 100) feed.lastChild.remove();
  }

  function addLogs(lines) {
    const tail = $("log-tail");
    const atBottom = tail.scrollHeight - tail.scrollTop - tail.clientHeight < 30;
    for (const line of lines) {
      if (lastLogId !== null && line.id <= lastLogId) continue;
      lastLogId = line.id;
      const span = document.createElement("span");
      span.className = `log-${line.level}`;
      span.dataset.logId = line.id;
      span.textContent = `${line.created.slice(11, 19)} ${line.level.padEnd(7)} ${line.message}\n`;
      tail.append(span);
    }
    while (tail.childNodes.length > 1000) tail.firstChild.remove();
    if (atBottom) tail.scrollTop = tail.scrollHeight;
  }

  function addCheckpoints(rows) {
    const list = $("checkpoints");
    for (const row of rows) {
      if (list.querySelector(`[data-checkpoint-id="${row.id}"]`)) continue;
      const empty = list.querySelector(".empty");
      if (empty) empty.remove();
      const li = document.createElement("li");
      li.dataset.checkpointId = row.id;
      li.textContent = `step ${row.step}: ${row.path}`;
      list.append(li);
    }
  }

  async function catchUp() {
    if (fetching) return fetching;
    const params = new URLSearchParams();
    // Re-read the cursor's own step: its batch may have been split.
    if (cursor !== null) params.set("since", cursor - 1);
    if (lastLogId !== null) params.set("log_after", lastLogId);
    fetching = fetch(`${live.updates}?${params}`, { credentials: "same-origin" })
      .then((response) => {
        if (!response.ok) throw new Error(`updates: HTTP ${response.status}`);
        return response.json();
      })
      .then((data) => {
        for (const [name, points] of Object.entries(data.metrics)) points.forEach((p) => addMetric(name, p));
        addRollouts(data.rollouts);
        addLogs(data.logs);
        addCheckpoints(data.checkpoints);
        setStatus(data.job);
      })
      .catch((error) => {
        $("live-state").textContent = `could not load updates (${error.message}); retrying…`;
        setTimeout(catchUp, 3000);
      })
      .finally(() => {
        fetching = null;
      });
    return fetching;
  }

  function applyUpdate(message) {
    if (message.since_step !== null && message.since_step !== undefined && (cursor === null || cursor < message.since_step)) {
      catchUp(); // a batch went missing in between
    }
    for (const point of message.metrics) addMetric(point.name, point);
    addRollouts(message.rollouts);
    addLogs(message.logs);
    addCheckpoints(message.checkpoints || []);
    if (message.progress) setProgress(message.progress);
    if (message.last_step !== null && message.last_step !== undefined) cursor = Math.max(cursor ?? message.last_step, message.last_step);
  }

  function connect() {
    const scheme = window.location.protocol === "https:" ? "wss://" : "ws://";
    socket = new WebSocket(scheme + window.location.host + live.ws);
    socket.onopen = () => {
      retryDelay = 1000;
      $("live-state").textContent = "live";
      catchUp();
    };
    socket.onmessage = (event) => {
      const message = JSON.parse(event.data);
      if (message.type === "job.update") applyUpdate(message);
      else if (message.type === "job.status") setStatus(message);
    };
    socket.onclose = (event) => {
      if (event.code === 4401 || event.code === 4403) {
        $("live-state").textContent = "live updates refused (not logged in, or not your job)";
        return;
      }
      if (TERMINAL.includes(status)) return;
      $("live-state").textContent = "connection lost; reconnecting…";
      setTimeout(connect, retryDelay);
      retryDelay = Math.min(retryDelay * 2, 15000);
    };
  }

  catchUp();
  if (!TERMINAL.includes(status)) connect();
})();
