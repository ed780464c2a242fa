// The thumbq progress page: polls GET /api/thumbnails/progress honouring poll_after_ms and its
// ETag, or follows the group's private Realtime topic when configured (with the user's own
// token), falling back to polling when that fails or stays silent. Job data is only ever written with textContent, never as HTML.
(function () {
  "use strict";

  const KEY_STORE = "thumbq.key";
  const MIN_POLL_MS = 250;
  const MAX_POLL_MS = 60000;
  const ERROR_BACKOFF_MS = [1000, 2000, 4000, 8000, 15000, 30000, 60000];
  // Once Realtime has delivered the group's changes, polling is only a backstop for missed ones.
  const REALTIME_BACKSTOP_MS = 15000;
  const REALTIME_FETCH_GAP_MS = 300;
  const FAILURES_LIMIT = 20;

  let cfg = {};
  try {
    cfg = JSON.parse(document.getElementById("thumbq-config").textContent || "{}");
  } catch (e) {
    cfg = {};
  }
  const apiBase = String(cfg.api_base || "").replace(/\/+$/, "");
  const groupId = new URLSearchParams(location.search).get("group_id");

  const $ = (id) => document.getElementById(id);
  const state = {
    etag: null,
    pollAfterMs: 1000,
    timer: null,
    inFlight: false,
    errors: 0,
    last: null,
    failuresSig: null,
    realtime: "off", // off | connecting | live | failed
    realtimeHeard: false, // Realtime announced a change: polling may slow to the backstop
    realtimeAnnounced: false, // the next answer was asked for because Realtime announced it
    lastRealtimeFetch: 0,
    stopped: false,
  };

  // -- the access key (admin secret or a user's JWT), per tab --------------------------------

  function takeKeyFromFragment() {
    // `#key=...` lets `thumbq up` print one link; the fragment never reaches a server.
    const hash = new URLSearchParams(location.hash.replace(/^#/, ""));
    const key = hash.get("key");
    if (key) {
      sessionStorage.setItem(KEY_STORE, key);
      history.replaceState(null, "", location.pathname + location.search);
    }
  }
  const getKey = () => sessionStorage.getItem(KEY_STORE) || "";
  const looksLikeJwt = (k) => /^[\w-]+\.[\w-]+\.[\w-]+$/.test(k);

  function authHeaders() {
    const key = getKey();
    return key ? { Authorization: "Bearer " + key } : {};
  }

  function askForKey(why) {
    $("key-form").hidden = false;
    showMessage(why);
    $("key-input").focus();
  }

  // -- rendering ---------------------------------------------------------------------------

  function showMessage(text) {
    const el = $("message");
    el.textContent = text || "";
    el.hidden = !text;
  }

  function setMode(text, kind) {
    const el = $("mode");
    el.textContent = text;
    el.className = "mode" + (kind ? " " + kind : "");
  }

  function fmtDuration(s) {
    if (s === null || s === undefined) return "unknown";
    if (s <= 0) return "done";
    if (s < 60) return Math.ceil(s) + " s";
    if (s < 3600) return Math.floor(s / 60) + " min " + Math.round(s % 60) + " s";
    return Math.floor(s / 3600) + " h " + Math.round((s % 3600) / 60) + " min";
  }

  function fmtAgo(iso) {
    const t = Date.parse(iso);
    if (Number.isNaN(t)) return "";
    const s = Math.max(0, Math.round((Date.now() - t) / 1000));
    return s < 60 ? s + " s ago" : Math.round(s / 60) + " min ago";
  }

  // The bar's segments, in order: each outcome's share of the group, so that 100% with
  // failures shows red and amber beside the green instead of one green bar.
  const SEGMENTS = ["completed", "failed", "unsupported", "cancelled", "processing"];

  function renderBar(p) {
    const total = Number(p.total) || 0;
    for (const s of SEGMENTS) {
      const share = total > 0 ? (100 * (Number(p[s]) || 0)) / total : 0;
      const seg = $("seg-" + s);
      seg.style.width = share + "%";
      seg.title = s + ": " + (p[s] ?? 0);
    }
  }

  function render(p) {
    const pct = Math.max(0, Math.min(100, Number(p.progress_percentage) || 0));
    const done = p.total - p.pending - p.processing;
    renderBar(p);
    document.querySelector(".bar").setAttribute("aria-valuenow", String(pct));
    $("percent").textContent = (pct === 100 ? "100" : pct.toFixed(1)) + "%";
    $("done-of-total").textContent = done + " of " + p.total + " files";
    const eta = p.estimated_time_remaining_seconds;
    $("eta").textContent =
      p.pending + p.processing === 0 ? "finished" : "ETA " + fmtDuration(eta);
    for (const s of ["completed", "failed", "unsupported", "cancelled", "processing", "pending"]) {
      $("count-" + s).textContent = String(p[s] ?? 0);
    }
    $("updated").textContent = p.updated_at ? "last change " + fmtAgo(p.updated_at) : "";
    $("retry").disabled = !(p.failed > 0);
    document.title = pct.toFixed(0) + "% - thumbq " + p.group_id;
  }

  // A file name as text with a line-break opportunity after each separator, so that a long
  // key wraps between its parts ("uploads/", "keynote-") instead of in the middle of a word.
  function keyNode(text) {
    const frag = document.createDocumentFragment();
    for (const part of String(text).split(/(?<=[\/\-_.])/)) {
      frag.append(document.createTextNode(part), document.createElement("wbr"));
    }
    return frag;
  }

  function fmtAt(iso) {
    const t = Date.parse(iso);
    if (Number.isNaN(t)) return "";
    return new Date(t).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
  }

  // What happens next to a file, from its status: a retry is only promised when one will come.
  function retryText(f) {
    if (f.status === "pending" || f.status === "processing") {
      const next = f.next_attempt_at ? " at " + fmtAt(f.next_attempt_at) : "";
      return "attempt " + (Number(f.attempts) + 1) + " of " + f.max_attempts + next;
    }
    if (f.permanent) return "no retry (permanent error)";
    return "gave up after " + f.attempts + " attempts";
  }

  function renderFailures(rows) {
    const body = $("failures-body");
    body.replaceChildren();
    for (const f of rows) {
      const tr = document.createElement("tr");
      const key = document.createElement("td");
      key.className = "key";
      key.title = f.source_key;
      key.append(keyNode(f.source_key));
      const status = document.createElement("td");
      status.className = "status";
      status.textContent = f.status === "pending" || f.status === "processing" ? "retrying" : f.status;
      const err = document.createElement("td");
      const code = document.createElement("span");
      code.className = "code " + String(f.error_code || "").replace(/[^\w-]/g, "");
      code.textContent = f.error_code || "";
      const msg = document.createElement("div");
      msg.className = "error-message";
      msg.textContent = f.last_error || "";
      err.append(code, msg);
      const retry = document.createElement("td");
      retry.className = "retry";
      retry.textContent = retryText(f);
      const when = document.createElement("td");
      when.className = "when";
      when.dataset.at = f.updated_at;
      when.textContent = fmtAgo(f.updated_at);
      tr.append(key, status, err, retry, when);
      body.append(tr);
    }
    $("failures-table").hidden = rows.length === 0;
    $("failures-empty").hidden = rows.length > 0;
  }

  // -- polling ------------------------------------------------------------------------------

  function schedule(ms) {
    clearTimeout(state.timer);
    if (state.stopped) return;
    state.timer = setTimeout(poll, Math.max(MIN_POLL_MS, Math.min(MAX_POLL_MS, ms)));
  }

  function nextDelay() {
    const ms = state.pollAfterMs;
    // A subscription alone proves nothing (a topic the user may not receive, broadcasts not
    // set up): only a channel that has delivered a change lets polling slow down.
    const trusted = state.realtime === "live" && state.realtimeHeard;
    return trusted ? Math.max(ms, REALTIME_BACKSTOP_MS) : ms;
  }

  async function poll() {
    if (state.inFlight || state.stopped) return;
    if (document.hidden) return; // resumed by visibilitychange
    state.inFlight = true;
    try {
      await pollOnce();
    } catch (e) {
      // A body that is not the JSON we expect (a proxy's error page, say): keep polling.
      backOff(null, "unexpected answer from the server");
    } finally {
      state.inFlight = false;
    }
  }

  async function pollOnce() {
    let resp;
    try {
      const headers = { Accept: "application/json", ...authHeaders() };
      if (state.etag) headers["If-None-Match"] = state.etag;
      resp = await fetch(
        apiBase + "/api/thumbnails/progress?group_id=" + encodeURIComponent(groupId),
        { headers, cache: "no-store" }
      );
    } catch (e) {
      return backOff(null, "cannot reach the server");
    }
    const hinted = Number(resp.headers.get("X-Poll-After-Ms"));
    if (resp.status === 304) {
      state.errors = 0;
      if (hinted > 0) state.pollAfterMs = hinted;
      modeForPolling();
      return schedule(nextDelay());
    }
    if (resp.status === 200) {
      const p = await resp.json();
      state.errors = 0;
      state.etag = resp.headers.get("ETag");
      state.pollAfterMs = Number(p.poll_after_ms) || hinted || 1000;
      // A change that Realtime did not announce: it is not delivering, so poll at the
      // endpoint's own pace again.
      if (state.last && !state.realtimeAnnounced) state.realtimeHeard = false;
      state.realtimeAnnounced = false;
      state.last = p;
      showMessage("");
      $("key-form").hidden = true;
      render(p);
      modeForPolling();
      refreshFailures(p);
      refreshGallery(p);
      return schedule(nextDelay());
    }
    if (resp.status === 401 || resp.status === 403) {
      state.etag = null;
      setMode("needs a key", "offline");
      return askForKey(await errorText(resp, "this page needs the admin secret or a token"));
    }
    if (resp.status === 404) {
      state.etag = null;
      showMessage("No group " + JSON.stringify(groupId) + " (or you may not see it); retrying.");
      setMode("waiting for the group", "");
      return schedule(30000);
    }
    return backOff(resp, await errorText(resp, "the server answered " + resp.status));
  }

  function backOff(resp, why) {
    const step = ERROR_BACKOFF_MS[Math.min(state.errors, ERROR_BACKOFF_MS.length - 1)];
    state.errors += 1;
    const retryAfter = resp ? Number(resp.headers.get("Retry-After")) * 1000 : 0;
    const ms = Math.max(step, retryAfter || 0);
    setMode("offline, retrying in " + Math.round(ms / 1000) + " s", "offline");
    showMessage(why);
    schedule(ms);
  }

  function modeForPolling() {
    if (state.realtime === "live" && state.realtimeHeard) setMode("live (Realtime)", "live");
    else setMode("polling every " + (state.pollAfterMs / 1000).toFixed(1) + " s", "");
  }

  async function errorText(resp, fallback) {
    try {
      const body = await resp.json();
      return (body && body.error && body.error.message) || fallback;
    } catch (e) {
      return fallback;
    }
  }

  // -- failures and retry -------------------------------------------------------------------

  async function refreshFailures(p) {
    // Only when something that can add or clear a failure moved.
    const sig = [p.failed, p.unsupported, p.cancelled, p.pending, p.processing, p.total].join(",");
    if (sig === state.failuresSig) return;
    state.failuresSig = sig;
    try {
      const resp = await fetch(
        apiBase +
          "/api/thumbnails/failures?group_id=" +
          encodeURIComponent(groupId) +
          "&limit=" +
          FAILURES_LIMIT,
        { headers: { Accept: "application/json", ...authHeaders() }, cache: "no-store" }
      );
      if (!resp.ok) {
        state.failuresSig = null; // try again with the next progress answer
        return;
      }
      const body = await resp.json();
      renderFailures(body.failures || []);
    } catch (e) {
      state.failuresSig = null;
    }
  }

  async function retryFailed() {
    const key = getKey();
    if (!key) return askForKey("Retrying needs the admin secret.");
    $("retry").disabled = true;
    $("retry-result").textContent = "Retrying...";
    try {
      const resp = await fetch(apiBase + "/api/thumbnails/retry-failed", {
        method: "POST",
        headers: { "Content-Type": "application/json", ...authHeaders() },
        body: JSON.stringify({ group_id: groupId }),
        cache: "no-store",
      });
      if (resp.ok) {
        const body = await resp.json();
        $("retry-result").textContent = body.requeued + " job(s) queued again.";
      } else if (resp.status === 401 || resp.status === 403) {
        $("retry-result").textContent = "";
        askForKey(await errorText(resp, "retrying needs the admin secret"));
      } else {
        $("retry-result").textContent = await errorText(resp, "retry failed: " + resp.status);
      }
    } catch (e) {
      $("retry-result").textContent = "cannot reach the server";
    }
    state.failuresSig = null;
    poll();
  }

  // -- the gallery of finished thumbnails ------------------------------------------------------
  // A page of the newest finished jobs first; more as the bottom of the grid scrolls into view
  // (IntersectionObserver), and each <img> itself loads lazily. The URLs come from the API:
  // presigned by S3, or signed for /api/thumbnails/image with local files (an <img> cannot
  // send the Authorization header). While work runs, the loaded pages are refreshed at most
  // every GALLERY_REFRESH_MS, and figures already shown are kept, so images do not reload.

  const GALLERY_PAGE = 48;
  const GALLERY_REFRESH_MS = 3000;
  const COLOR_RE = /^#[0-9a-fA-F]{6}$/;
  const gallery = {
    pages: 1,
    nextBefore: null,
    sig: null,
    lastFetch: 0,
    timer: null,
    busy: false,
    figures: new Map(), // job id -> <li>
  };

  async function fetchGalleryPage(before) {
    const resp = await fetch(
      apiBase +
        "/api/thumbnails/gallery?group_id=" +
        encodeURIComponent(groupId) +
        "&limit=" +
        GALLERY_PAGE +
        (before ? "&before=" + before : ""),
      { headers: { Accept: "application/json", ...authHeaders() }, cache: "no-store" }
    );
    if (!resp.ok) throw new Error("gallery: " + resp.status);
    return resp.json();
  }

  function galleryItem(item) {
    const li = document.createElement("li");
    li.dataset.job = String(item.job_id);
    const frame = document.createElement("div");
    frame.className = "frame";
    // Placeholders while the image loads: the dominant colour where the job records one, and
    // over it the job's ThumbHash decoded into a blurred picture of the thumbnail's shape.
    if (COLOR_RE.test(String(item.dominant_color || ""))) {
      frame.style.backgroundColor = item.dominant_color;
    }
    const preview =
      item.thumbhash && window.thumbhash ? window.thumbhash.canvas(item.thumbhash) : null;
    if (preview) {
      preview.className = "placeholder";
      const ratio = preview.width / preview.height;
      preview.style.width = ratio >= 1 ? "100%" : (100 * ratio).toFixed(1) + "%";
      preview.style.height = ratio >= 1 ? (100 / ratio).toFixed(1) + "%" : "100%";
      frame.append(preview);
    }
    const img = document.createElement("img");
    img.loading = "lazy";
    img.decoding = "async";
    img.alt = item.source_key;
    if (item.width && item.height) {
      img.width = item.width;
      img.height = item.height;
    }
    img.addEventListener("error", () => {
      // Most likely an expired URL: the next refresh hands out a fresh one.
      li.dataset.failed = "1";
      gallery.sig = null;
    });
    if (preview) img.addEventListener("load", () => preview.remove(), { once: true });
    setImageUrl(img, item.url);
    frame.append(img);
    const name = document.createElement("div");
    name.className = "name";
    name.title = item.source_key;
    name.textContent = String(item.source_key).split("/").pop();
    li.append(frame);
    const strip = pageStrip(item.pages);
    if (strip) li.append(strip);
    li.append(name);
    return li;
  }

  // A document's pages (THUMBQ_PAGES), in order, as a strip of small pictures under its frame.
  function pageStrip(pages) {
    if (!Array.isArray(pages) || pages.length < 2) return null;
    const strip = document.createElement("ol");
    strip.className = "pages";
    for (const p of pages) {
      const li = document.createElement("li");
      const img = document.createElement("img");
      img.loading = "lazy";
      img.decoding = "async";
      img.alt = "page " + Number(p.page);
      img.title = img.alt;
      setImageUrl(img, p.url);
      li.append(img);
      strip.append(li);
    }
    return strip;
  }

  function setImageUrl(img, url) {
    img.src = String(url).startsWith("/") ? apiBase + url : url;
  }

  function mergeGallery(items) {
    const grid = $("grid");
    for (const item of items) {
      const known = gallery.figures.get(item.job_id);
      if (known) {
        if (known.dataset.failed) {
          delete known.dataset.failed;
          setImageUrl(known.querySelector("img"), item.url);
        }
        continue;
      }
      const li = galleryItem(item);
      gallery.figures.set(item.job_id, li);
      // Newest job first: before the first figure with a smaller id.
      const after = [...grid.children].find((c) => Number(c.dataset.job) < item.job_id);
      grid.insertBefore(li, after || null);
    }
    $("gallery").hidden = gallery.figures.size === 0;
    $("gallery-count").textContent =
      gallery.figures.size + (gallery.nextBefore ? "+" : "") + " finished";
  }

  async function loadGallery() {
    // The pages loaded so far, from the top: new figures may land anywhere in id order.
    if (gallery.busy) return;
    gallery.busy = true;
    gallery.lastFetch = Date.now();
    try {
      let before = null;
      for (let page = 0; page < gallery.pages; page++) {
        const body = await fetchGalleryPage(before);
        gallery.nextBefore = body.next_before;
        mergeGallery(body.thumbnails || []);
        before = body.next_before;
        if (!before) break;
      }
    } catch (e) {
      gallery.sig = null; // try again with the next progress answer
    } finally {
      gallery.busy = false;
    }
    $("grid-more").hidden = !gallery.nextBefore;
  }

  function refreshGallery(p) {
    const sig = [p.completed, p.total].join(",");
    if (sig === gallery.sig) return;
    gallery.sig = sig;
    clearTimeout(gallery.timer);
    const wait = Math.max(0, gallery.lastFetch + GALLERY_REFRESH_MS - Date.now());
    gallery.timer = setTimeout(loadGallery, wait);
  }

  async function loadMoreGallery() {
    if (gallery.busy || !gallery.nextBefore) return;
    gallery.busy = true;
    try {
      const body = await fetchGalleryPage(gallery.nextBefore);
      gallery.pages += 1;
      gallery.nextBefore = body.next_before;
      mergeGallery(body.thumbnails || []);
    } catch (e) {
      return; // the next scroll or refresh tries again
    } finally {
      gallery.busy = false;
    }
    const more = $("grid-more");
    more.hidden = !gallery.nextBefore;
    // Still in view after a short page: the observer sees no new crossing, so keep going.
    if (!more.hidden && more.getBoundingClientRect().top < window.innerHeight + 400) {
      loadMoreGallery();
    }
  }

  function watchGalleryEnd() {
    if (!("IntersectionObserver" in window)) return;
    new IntersectionObserver(
      (entries) => {
        if (entries.some((e) => e.isIntersecting)) loadMoreGallery();
      },
      { rootMargin: "400px" }
    ).observe($("grid-more"));
  }

  // -- Supabase Realtime (optional) ---------------------------------------------------------

  async function startRealtime() {
    if (!cfg.supabase_url || !cfg.supabase_anon_key || !cfg.supabase_js_url) return;
    // The group's topic is private, authorised per user (RLS on realtime.messages): only a
    // user's access token can join it. With the admin secret, a page token or no key the anon
    // key would join nothing, so the page just polls.
    const key = getKey();
    if (state.realtime !== "off") return;
    if (!looksLikeJwt(key)) return setRealtime("off");
    setRealtime("connecting");
    let mod;
    try {
      mod = await import(cfg.supabase_js_url);
    } catch (e) {
      return realtimeFailed("could not load supabase-js");
    }
    try {
      const client = mod.createClient(cfg.supabase_url, cfg.supabase_anon_key, {
        auth: { persistSession: false, autoRefreshToken: false },
      });
      await client.realtime.setAuth(key); // joins as the user, not as anon
      // sql/006_realtime.sql broadcasts every change of the group's row to this topic.
      client
        .channel("thumbq:group:" + groupId, { config: { private: true } })
        .on("broadcast", { event: "progress" }, onRealtimeChange)
        .subscribe((status) => {
          if (status === "SUBSCRIBED") {
            setRealtime("live");
            modeForPolling();
            schedule(nextDelay());
          } else if (status === "CHANNEL_ERROR" || status === "TIMED_OUT" || status === "CLOSED") {
            realtimeFailed("Realtime " + status.toLowerCase());
          }
        });
    } catch (e) {
      realtimeFailed("Realtime failed");
    }
  }

  function setRealtime(value) {
    state.realtime = value;
    document.body.dataset.realtime = value; // for people and tests inspecting the page
  }

  function realtimeFailed(why) {
    setRealtime("failed");
    setMode("polling (" + why + ")", "");
    // Back to the endpoint's own cadence at once.
    schedule(0);
  }

  function onRealtimeChange() {
    // The event says the row changed; the endpoint gives the same shape as polling (with ETA).
    state.realtimeHeard = true;
    state.realtimeAnnounced = true;
    const now = Date.now();
    const wait = Math.max(0, state.lastRealtimeFetch + REALTIME_FETCH_GAP_MS - now);
    state.lastRealtimeFetch = now + wait;
    schedule(wait);
  }

  // -- start --------------------------------------------------------------------------------

  function start() {
    takeKeyFromFragment();
    $("key-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const key = $("key-input").value.trim();
      if (!key) return;
      sessionStorage.setItem(KEY_STORE, key);
      $("key-input").value = "";
      $("key-form").hidden = true;
      showMessage("");
      state.etag = null;
      state.failuresSig = null;
      poll();
      startRealtime(); // a user's token entered now may join the group's topic
    });
    if (!groupId) {
      $("group-form").hidden = false;
      $("summary").hidden = true;
      $("failures").hidden = true;
      return;
    }
    $("group-id").textContent = groupId;
    $("retry").addEventListener("click", retryFailed);
    watchGalleryEnd();
    // Relative times ("12 s ago") age between answers too.
    setInterval(() => {
      if (state.last && state.last.updated_at) {
        $("updated").textContent = "last change " + fmtAgo(state.last.updated_at);
      }
      for (const td of document.querySelectorAll("td.when")) td.textContent = fmtAgo(td.dataset.at);
    }, 5000);
    document.addEventListener("visibilitychange", () => {
      if (!document.hidden) poll();
    });
    if (!getKey()) {
      setMode("needs a key", "offline");
      askForKey("Enter the admin secret (or a Supabase access token) to see this group.");
    } else {
      poll();
    }
    startRealtime();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
