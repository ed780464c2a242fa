// Netlify scheduled function (schedule in netlify.toml): one time-budgeted batch per call.
// The API does the work and reports it; this only knocks on its door with the cron secret.
export default async () => {
  const base = (process.env.THUMBQ_API_URL || "").replace(/\/+$/, "");
  const secret = process.env.THUMBQ_CRON_SECRET || "";
  if (!base || !secret) {
    console.error("thumbq-batch: set THUMBQ_API_URL and THUMBQ_CRON_SECRET");
    return new Response("not configured", { status: 500 });
  }
  const resp = await fetch(`${base}/api/thumbnails/batch-generate`, {
    method: "POST",
    headers: { Authorization: `Bearer ${secret}`, "Content-Type": "application/json" },
    body: "{}",
  });
  const text = await resp.text();
  console.log(JSON.stringify({ event: "thumbq_batch", status: resp.status, body: text.slice(0, 500) }));
  return new Response(text, { status: resp.status, headers: { "Content-Type": "application/json" } });
};
