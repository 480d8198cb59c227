/* The live game page.
 *
 * A click on a cell posts the move to the JSON endpoint and shows the server's answer
 * (the game after the move, or why the move was refused). The model's move is made by a
 * worker; the websocket brings the game's JSON as the worker committed it, so the page
 * shows the move at once (a message without it makes the page read the game). While the
 * model is thinking the page also polls, quickly when the socket is down and slowly when
 * it is up, since a channel message can be lost. A finished game can be replayed move by move. */
"use strict";

(() => {
  const live = JSON.parse(document.getElementById("play-live").textContent);
  const $ = (id) => document.getElementById(id);
  const form = $("board-form");
  const csrf = form.querySelector("[name=csrfmiddlewaretoken]").value;
  const cells = [...document.querySelectorAll("#board .cell")];

  let game = null;
  let socket = null;
  let socketUp = false;
  let retryDelay = 1000;
  let pollTimer = null;
  let replayAt = null; // number of moves shown while replaying; null = the live board
  let requestSeq = 0;
  let shownSeq = 0;

  function showError(message) {
    const el = $("move-error");
    el.textContent = message || "";
    el.hidden = !message;
  }

  const LINES = [[0, 1, 2], [3, 4, 5], [6, 7, 8], [0, 3, 6], [1, 4, 7], [2, 5, 8], [0, 4, 8], [2, 4, 6]];

  function winningLine(board) {
    return LINES.find(([a, b, c]) => board[a] !== "." && board[a] === board[b] && board[b] === board[c]) || [];
  }

  function drawBoard(board, lastCell, finished) {
    const line = winningLine(board);
    cells.forEach((button, i) => {
      const mark = board[i];
      button.textContent = mark === "." ? "" : mark;
      button.dataset.mark = mark;
      button.className = "cell" + (mark === "." ? "" : ` taken mark-${mark.toLowerCase()}`) + (i === lastCell ? " last" : "") + (line.includes(i) ? " win" : "");
      button.setAttribute("aria-label", `cell ${i}` + (mark === "." ? "" : `: ${mark}`));
      button.disabled = finished;
    });
    $("board").classList.toggle("finished", finished);
  }

  function boardAfter(moves, count) {
    const board = Array(9).fill(".");
    moves.slice(0, count).forEach((move) => (board[move.cell] = move.mark));
    return board;
  }

  function drawMoves() {
    const list = $("move-list");
    list.replaceChildren();
    if (!game.moves.length) {
      const li = document.createElement("li");
      li.className = "empty";
      li.textContent = "none yet";
      list.append(li);
    }
    game.moves.forEach((move, i) => {
      const li = document.createElement("li");
      li.dataset.cell = move.cell;
      li.dataset.player = move.player;
      li.textContent = `${move.player === "model" ? game.player_name : "you"}: ${move.mark} → ${move.cell}`;
      if (replayAt !== null && i === replayAt - 1) li.className = "current";
      list.append(li);
    });
  }

  function drawReplies() {
    const container = $("turns");
    container.replaceChildren();
    const byMove = new Map();
    for (const reply of game.replies) {
      if (!byMove.has(reply.move_number)) byMove.set(reply.move_number, []);
      byMove.get(reply.move_number).push(reply);
    }
    if (!byMove.size) {
      const p = document.createElement("p");
      p.className = "empty";
      p.id = "no-replies";
      p.textContent = game.status === "model_turn" ? "The model is thinking…" : "The model has not moved yet.";
      container.append(p);
    }
    for (const [moveNumber, replies] of byMove) {
      const article = document.createElement("article");
      article.className = "turn";
      article.dataset.moveNumber = moveNumber;
      const h3 = document.createElement("h3");
      h3.textContent = `move ${moveNumber}`;
      article.append(h3);
      for (const reply of replies) {
        const div = document.createElement("div");
        div.className = `reply ${reply.valid ? "valid" : "invalid"}`;
        div.dataset.attempt = reply.attempt;
        if (reply.think) {
          const think = document.createElement("pre");
          think.className = "think";
          think.textContent = reply.think;
          div.append(think);
        }
        const line = document.createElement("p");
        if (reply.valid) {
          line.className = "played";
          line.append("played ");
          const strong = document.createElement("strong");
          strong.textContent = reply.move;
          line.append(strong);
          if (reply.attempt > 1) line.append(` (try ${reply.attempt})`);
        } else {
          line.className = "error";
          line.textContent = `invalid reply (try ${reply.attempt} of ${game.max_attempts}): ${reply.error}`;
        }
        div.append(line);
        const details = document.createElement("details");
        details.open = !reply.valid;
        const summary = document.createElement("summary");
        summary.textContent = "raw reply";
        const raw = document.createElement("pre");
        raw.className = "raw";
        raw.textContent = reply.text;
        details.append(summary, raw);
        div.append(details);
        article.append(div);
      }
      container.prepend(article); // newest first, next to the board
    }
    const count = document.querySelector("#model-replies h2 small");
    if (count) count.textContent = `${game.invalid_replies} invalid`;
  }

  function drawReplay() {
    const finished = game.status === "finished";
    $("replay").hidden = !finished;
    if (!finished) return;
    const shown = replayAt === null ? game.moves.length : replayAt;
    $("replay-position").textContent = `move ${shown} of ${game.moves.length}`;
  }

  function render(data) {
    game = data;
    const finished = game.status === "finished";
    const status = $("game-status");
    status.textContent = game.status_text;
    status.dataset.status = game.status;
    status.dataset.outcome = game.outcome || "";
    status.className = `game-status status-${game.status}`;
    $("retry-form").hidden = game.status !== "model_failed";
    if (replayAt === null) {
      const last = game.moves.length ? game.moves[game.moves.length - 1].cell : null;
      drawBoard(game.board, last, finished);
    }
    drawMoves();
    drawReplies();
    drawReplay();
    schedulePoll();
    if (finished && socket) socket.close(1000);
  }

  async function fetchGame() {
    const seq = ++requestSeq;
    try {
      const response = await fetch(live.api, { credentials: "same-origin", cache: "no-store" });
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      const data = await response.json();
      // An older answer must not overwrite a newer one (a poll racing a move).
      if (seq > shownSeq) {
        shownSeq = seq;
        render(data);
      }
    } catch (error) {
      $("live-state").textContent = `could not load the game (${error.message}); retrying…`;
      schedulePoll(3000);
    }
  }

  function schedulePoll(delay) {
    clearTimeout(pollTimer);
    pollTimer = null;
    if (!game || game.status !== "model_turn") {
      if (delay) pollTimer = setTimeout(fetchGame, delay);
      return;
    }
    pollTimer = setTimeout(fetchGame, delay || (socketUp ? 5000 : 1500));
  }

  async function play(cell) {
    showError("");
    replayAt = null;
    const seq = ++requestSeq;
    let response;
    try {
      response = await fetch(live.move, {
        method: "POST",
        credentials: "same-origin",
        headers: { "Content-Type": "application/json", "X-CSRFToken": csrf },
        body: JSON.stringify({ cell }),
      });
    } catch (error) {
      showError(`could not send the move: ${error.message}`);
      return;
    }
    const data = await response.json().catch(() => ({}));
    if (!response.ok) {
      const errors = data.errors || {};
      const messages = Object.values(errors).flat();
      showError(messages.join(" ") || data.error || `HTTP ${response.status}`);
      return;
    }
    if (seq > shownSeq) {
      shownSeq = seq;
      render(data);
    }
  }

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const button = event.submitter;
    if (button && button.name === "cell") play(Number(button.value));
  });

  $("replay").addEventListener("click", (event) => {
    const action = event.target.dataset.replay;
    if (!action || !game) return;
    const total = game.moves.length;
    const at = replayAt === null ? total : replayAt;
    const next = { first: 0, prev: Math.max(0, at - 1), next: Math.min(total, at + 1), last: total }[action];
    replayAt = next === total ? null : next;
    const board = boardAfter(game.moves, next);
    drawBoard(board, next ? game.moves[next - 1].cell : null, true);
    drawMoves();
    drawReplay();
  });

  function connect() {
    const scheme = window.location.protocol === "https:" ? "wss://" : "ws://";
    socket = new WebSocket(scheme + window.location.host + live.ws);
    socket.onopen = () => {
      socketUp = true;
      retryDelay = 1000;
      $("live-state").textContent = "live";
      fetchGame();
    };
    socket.onmessage = (event) => {
      const message = JSON.parse(event.data);
      if (message.type !== "game.update") return;
      // A message is the newest state the page knows of: answers of reads started
      // before it are dropped (a message older than the board shown is not drawn).
      if (message.data && (!game || message.data.moves.length >= game.moves.length)) {
        shownSeq = ++requestSeq;
        render(message.data);
      } else {
        fetchGame();
      }
    };
    socket.onclose = (event) => {
      socketUp = false;
      if (event.code === 4401 || event.code === 4403) {
        $("live-state").textContent = "live updates refused (not logged in, or not your game)";
        return;
      }
      if (game && game.status === "finished") {
        $("live-state").textContent = "";
        return;
      }
      $("live-state").textContent = "connection lost; reconnecting (polling meanwhile)…";
      schedulePoll();
      setTimeout(connect, retryDelay);
      retryDelay = Math.min(retryDelay * 2, 15000);
    };
  }

  fetchGame();
  if (live.status !== "finished") connect();
})();
