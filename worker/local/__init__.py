"""thumbq on one machine: the embedded Postgres and its home, a local server, the cron
scheduler, the watch client, the terminal and the demo samples."""
