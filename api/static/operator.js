// The operator page: reads GET /api/ops/overview with the admin secret every few seconds and
// draws it; replays dead letters (POST /api/ops/dlq/replay) and cancels running jobs
// (POST /api/jobs/<id>/cancel). Everything from the server is shown as text, never as markup.
(() => {
  "use strict";

  const KEY_STORE = "thumbq.admin";
  const POLL_MS = 5000;
  const $ = (id) => document.getElementById(id);
  let timer = null;
  let busy = false;

  // -- the admin secret, per tab (as the progress page keeps its key) ------------------------
  function takeKeyFromHash() {
    const hash = new URLSearchParams(location.hash.slice(1));
    const key = hash.get("key");
    if (key) {
      sessionStorage.setItem(KEY_STORE, key);
      history.replaceState(null, "", location.pathname + location.search);
    }
  }
  const getKey = () => sessionStorage.getItem(KEY_STORE) || "";
  const authHeaders = () => (getKey() ? { Authorization: "Bearer " + getKey() } : {});

  function askForKey(message) {
    $("key-form").hidden = false;
    showMessage(message);
    $("key-input").focus();
  }

  function showMessage(text) {
    $("message").textContent = text || "";
    $("message").hidden = !text;
  }

  function setMode(text, cls) {
    const el = $("mode");
    el.textContent = text;
    el.className = "mode" + (cls ? " " + cls : "");
  }

  async function errorText(resp, fallback) {
    try {
      const body = await resp.json();
      if (body && body.error && body.error.message) return body.error.message;
    } catch (_) {
      /* not JSON */
    }
    return fallback + " (HTTP " + resp.status + ")";
  }

  // -- small formatting helpers ----------------------------------------------------------------
  function el(tag, text, cls) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (cls) node.className = cls;
    return node;
  }

  function age(seconds) {
    if (seconds === null || seconds === undefined) return "-";
    const s = Math.max(0, Math.round(seconds));
    if (s < 90) return s + " s";
    if (s < 5400) return Math.round(s / 60) + " min";
    if (s < 172800) return Math.round(s / 3600) + " h";
    return Math.round(s / 86400) + " d";
  }

  const since = (iso) => (iso ? age((Date.now() - Date.parse(iso)) / 1000) + " ago" : "-");
  const what = (job) => job.source_key || job.task + " #" + job.job_id;

  function fill(bodyId, emptyId, rows, render) {
    const body = $(bodyId);
    body.replaceChildren(...rows.map(render));
    if (emptyId) $(emptyId).hidden = rows.length > 0;
  }

  // -- the sections ------------------------------------------------------------------------------
  function renderQueues(queues) {
    fill("queues-body", null, queues, (q) => {
      const tr = el("tr");
      tr.dataset.queue = q.queue;
      const name = q.queue === "thumbq_dlq" ? "thumbq_dlq (dead letters)" : q.queue;
      tr.append(
        el("td", name, "key"),
        el("td", q.priority === null ? q.depth : q.waiting, "num waiting"),
        el("td", q.priority === null ? "-" : q.in_flight, "num"),
        el("td", age(q.oldest_age_s), "num"),
      );
      return tr;
    });
  }

  function renderTasks(tasks) {
    fill("tasks-body", "tasks-empty", tasks, (t) => {
      const tr = el("tr");
      tr.append(
        el("td", t.task, "key"),
        el("td", t.pending, "num"),
        el("td", t.processing, "num"),
        el("td", t.completed_1h, "num"),
        el("td", t.failed_1h, "num"),
      );
      return tr;
    });
  }

  function renderFailures(failures) {
    fill("failures-body", "failures-empty", failures, (f) => {
      const tr = el("tr");
      tr.dataset.code = f.error_code;
      const code = el("td");
      code.append(el("span", f.error_code, "code"));
      const statuses = Object.entries(f.statuses || {})
        .map(([s, n]) => n + " " + s)
        .join(", ");
      code.append(el("div", statuses, "note"));
      const ex = el("td", null, "ex");
      for (const e of f.examples || []) {
        const line = el("div");
        line.append(el("span", what(e)));
        if (e.message) line.append(el("div", e.message, "msg"));
        ex.append(line);
      }
      tr.append(code, el("td", f.count, "num"), ex);
      return tr;
    });
  }

  function actionButton(label, cls, onClick) {
    const b = el("button", label, cls);
    b.type = "button";
    b.addEventListener("click", () => onClick(b));
    return b;
  }

  function renderDeadLetters(dead, total) {
    $("dlq-total").textContent = total ? "(" + total + ")" : "";
    $("replay-all").disabled = !total;
    fill("dlq-body", "dlq-empty", dead, (d) => {
      const tr = el("tr");
      tr.dataset.job = d.job_id;
      const why = el("td");
      why.append(el("span", d.error_code, "code"), el("div", d.message, "msg"));
      const act = el("td");
      act.append(actionButton("Replay", "replay", (b) => replay([d.job_id], b)));
      tr.append(el("td", d.job_id, "id"), el("td", what(d), "key"), why,
                el("td", since(d.failed_at)), act);
      return tr;
    });
  }

  function renderRunning(running) {
    fill("running-body", "running-empty", running, (r) => {
      const tr = el("tr");
      tr.dataset.job = r.job_id;
      const stale = r.lease_expires_at && Date.parse(r.lease_expires_at) < Date.now();
      if (stale) tr.className = "stale";
      const act = el("td");
      act.append(actionButton("Cancel", "cancel danger", (b) => cancelJob(r.job_id, b)));
      let label = what(r);
      if (r.progress_total) label += " (" + r.progress_done + "/" + r.progress_total + ")";
      tr.append(el("td", r.job_id, "id"), el("td", label, "key"),
                el("td", r.worker_id + (stale ? " (lease expired)" : ""), "msg"),
                el("td", since(r.started_at)), act);
      return tr;
    });
  }

  function renderRuns(runs) {
    fill("runs-body", "runs-empty", runs, (r) => {
      const tr = el("tr");
      tr.append(
        el("td", "#" + r.id, "id"),
        el("td", since(r.started_at)),
        el("td", r.succeeded, "num"),
        el("td", r.failed, "num"),
        el("td", r.remaining === null ? "-" : r.remaining, "num"),
        el("td", r.duration_ms === null ? "running" : (r.duration_ms / 1000).toFixed(1) + " s",
           "num"),
        el("td", r.stopped_reason || "-"),
      );
      return tr;
    });
  }

  // Finished jobs per minute as stacked bars, drawn as plain SVG (no library).
  function renderChart(points) {
    const svg = $("chart");
    const NS = "http://www.w3.org/2000/svg";
    // The drawing's width is the element's, so that bars and labels keep their proportions.
    const W = Math.max(300, Math.round(svg.getBoundingClientRect().width) || 600);
    const H = 140, left = 28, bottom = 18, top = 8;
    svg.setAttribute("viewBox", "0 0 " + W + " " + H);
    const max = Math.max(1, ...points.map((p) => p.completed + p.failed));
    const slot = (W - left) / Math.max(points.length, 1);
    const y = (v) => ((H - bottom - top) * v) / max;
    const shapes = [];
    const line = (x1, y1, x2, y2) => {
      const l = document.createElementNS(NS, "line");
      l.setAttribute("x1", x1); l.setAttribute("y1", y1);
      l.setAttribute("x2", x2); l.setAttribute("y2", y2);
      l.setAttribute("class", "axis");
      return l;
    };
    const text = (x, yy, s, anchor) => {
      const t = document.createElementNS(NS, "text");
      t.setAttribute("x", x); t.setAttribute("y", yy);
      t.setAttribute("text-anchor", anchor || "start");
      t.textContent = s;
      return t;
    };
    shapes.push(line(left, H - bottom, W, H - bottom), line(left, top, W, top));
    shapes.push(text(left - 4, top + 8, String(max), "end"), text(left - 4, H - bottom, "0", "end"));
    points.forEach((p, i) => {
      const x = left + i * slot + 1;
      let base = H - bottom;
      for (const kind of ["completed", "failed"]) {
        const h = y(p[kind]);
        if (h <= 0) continue;
        const r = document.createElementNS(NS, "rect");
        r.setAttribute("x", x.toFixed(1));
        r.setAttribute("y", (base - h).toFixed(1));
        r.setAttribute("width", Math.max(1, slot - 2).toFixed(1));
        r.setAttribute("height", h.toFixed(1));
        r.setAttribute("class", kind);
        const tip = document.createElementNS(NS, "title");
        tip.textContent = p[kind] + " " + kind + " at " + new Date(p.minute).toLocaleTimeString();
        r.append(tip);
        shapes.push(r);
        base -= h;
      }
    });
    shapes.push(text(left, H - 4, "60 min ago"), text(W, H - 4, "now", "end"));
    svg.replaceChildren(...shapes);
    const total = points.reduce((n, p) => n + p.completed + p.failed, 0);
    svg.setAttribute("aria-label", total + " jobs finished in the last hour");
  }

  // -- reading and acting ------------------------------------------------------------------------
  async function refresh() {
    if (busy) return;
    if (!getKey()) return askForKey("This page needs the admin secret.");
    busy = true;
    try {
      const resp = await fetch("/api/ops/overview", { headers: authHeaders(), cache: "no-store" });
      if (resp.status === 401 || resp.status === 503) {
        setMode("needs the admin secret", "offline");
        return askForKey(await errorText(resp, "this page needs the admin secret"));
      }
      if (!resp.ok) {
        setMode("offline", "offline");
        return showMessage(await errorText(resp, "the overview could not be read"));
      }
      const o = await resp.json();
      $("key-form").hidden = true;
      showMessage("");
      renderQueues(o.queues || []);
      renderChart(o.throughput || []);
      renderTasks(o.tasks || []);
      renderFailures(o.failures || []);
      renderDeadLetters(o.dead_letters || [], o.dead_letters_total || 0);
      renderRunning(o.running || []);
      renderRuns(o.runs || []);
      setMode("live", "live");
      $("updated").textContent = "updated " + new Date(o.generated_at).toLocaleTimeString();
      document.body.dataset.loaded = "1";
    } catch (err) {
      setMode("offline", "offline");
      showMessage("The server did not answer: " + err.message);
    } finally {
      busy = false;
    }
  }

  async function post(path, body) {
    return fetch(path, {
      method: "POST",
      headers: { ...authHeaders(), "Content-Type": "application/json" },
      body: JSON.stringify(body),
    });
  }

  async function replay(jobIds, button) {
    if (button) button.disabled = true;
    const resp = await post("/api/ops/dlq/replay", jobIds ? { job_ids: jobIds } : { all: true });
    if (!resp.ok) {
      if (button) button.disabled = false;
      $("dlq-result").textContent = await errorText(resp, "replay failed");
      return;
    }
    const out = await resp.json();
    $("dlq-result").textContent = out.replayed + " job(s) queued again with fresh attempts.";
    await refresh();
  }

  async function cancelJob(jobId, button) {
    button.disabled = true;
    const resp = await post("/api/jobs/" + encodeURIComponent(jobId) + "/cancel", {});
    if (!resp.ok) {
      button.disabled = false;
      $("cancel-result").textContent = await errorText(resp, "cancel failed");
      return;
    }
    const out = await resp.json();
    $("cancel-result").textContent = out.cancelled
      ? "Job " + jobId + " cancelled."
      : "Job " + jobId + " had already finished.";
    await refresh();
  }

  function schedule() {
    clearInterval(timer);
    timer = setInterval(() => {
      if (!document.hidden) refresh();
    }, POLL_MS);
  }

  document.addEventListener("DOMContentLoaded", () => {
    takeKeyFromHash();
    $("key-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const key = $("key-input").value.trim();
      if (!key) return;
      sessionStorage.setItem(KEY_STORE, key);
      $("key-input").value = "";
      refresh();
    });
    $("replay-all").addEventListener("click", (ev) => replay(null, ev.currentTarget));
    document.addEventListener("visibilitychange", () => {
      if (!document.hidden) refresh();
    });
    refresh();
    schedule();
  });
})();
