"""A stand-in for Supabase Realtime's websocket endpoint, for the real clients to talk to.

Supabase Realtime is a Phoenix server; its clients (supabase-js in the browser, the `realtime`
package under `thumbq watch`) speak Phoenix channels over `/realtime/v1/websocket`: protocol
1.0.0 (JSON objects) or 2.0.0 (JSON arrays). This stub speaks enough of both for a client to
join a channel, and records every join, so that a test can check what the client sent (the
topic, `config.private`, the `access_token`). Like Realtime, it refuses to join a private
channel without an access token it accepts, and it delivers broadcasts the test sends. What it
does not do is authorise topics with RLS on realtime.messages (sql/006_realtime.sql's policy is
tested in SQL) or decode the WAL: only a live project shows those.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterable
from typing import Any
from urllib.parse import parse_qs, urlsplit

PATH = "/realtime/v1/websocket"


class RealtimeStub:
    """Serves on 127.0.0.1; `url` is what SUPABASE_URL would be (http://host:port)."""

    def __init__(self, accepted_tokens: Iterable[str] = ()) -> None:
        self.accepted_tokens = set(accepted_tokens)
        self.joins: list[dict[str, Any]] = []
        self.access_tokens: list[str] = []
        self._members: dict[str, list[tuple[Any, str, Any]]] = {}  # topic -> (ws, vsn, join_ref)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="realtime-stub", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        self.url = f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        from websockets.asyncio.server import serve

        self._server = await serve(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            await self._server.wait_closed()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    # -- protocol ---------------------------------------------------------------------------

    @staticmethod
    def _decode(vsn: str, raw: str | bytes) -> dict[str, Any]:
        data = json.loads(raw)
        if vsn.startswith("2"):
            join_ref, ref, topic, event, payload = data
            return {
                "join_ref": join_ref,
                "ref": ref,
                "topic": topic,
                "event": event,
                "payload": payload,
            }
        return dict(data)

    @staticmethod
    def _encode(vsn: str, msg: dict[str, Any]) -> str:
        if vsn.startswith("2"):
            return json.dumps(
                [msg.get("join_ref"), msg.get("ref"), msg["topic"], msg["event"], msg["payload"]]
            )
        return json.dumps(msg)

    async def _handle(self, ws: Any) -> None:
        query = parse_qs(urlsplit(ws.request.path).query)
        if urlsplit(ws.request.path).path != PATH:
            await ws.close(1008, "not found")
            return
        vsn = query.get("vsn", ["1.0.0"])[0]
        try:
            async for raw in ws:
                msg = self._decode(vsn, raw)
                await self._on_message(ws, vsn, msg)
        except Exception:  # a client that goes away mid-message
            pass
        finally:
            for members in self._members.values():
                members[:] = [m for m in members if m[0] is not ws]

    async def _reply(self, ws: Any, vsn: str, msg: dict[str, Any], payload: dict[str, Any]) -> None:
        out = {
            "join_ref": msg.get("join_ref"),
            "ref": msg.get("ref"),
            "topic": msg["topic"],
            "event": "phx_reply",
            "payload": payload,
        }
        await ws.send(self._encode(vsn, out))

    async def _on_message(self, ws: Any, vsn: str, msg: dict[str, Any]) -> None:
        event, topic, payload = msg["event"], msg["topic"], msg.get("payload") or {}
        if event == "heartbeat":
            await self._reply(ws, vsn, msg, {"status": "ok", "response": {}})
        elif event == "phx_join":
            config = payload.get("config") or {}
            self.joins.append({"topic": topic, "payload": payload, "vsn": vsn})
            token = payload.get("access_token")
            if config.get("private") and token not in self.accepted_tokens:
                await self._reply(
                    ws,
                    vsn,
                    msg,
                    {
                        "status": "error",
                        "response": {
                            "reason": "Unauthorized: You do not have permissions to "
                            "read from this Channel topic: " + topic
                        },
                    },
                )
                return
            self._members.setdefault(topic, []).append((ws, vsn, msg.get("join_ref")))
            await self._reply(ws, vsn, msg, {"status": "ok", "response": {"postgres_changes": []}})
            # Realtime then reports the subscription; clients treat it as informational.
            await ws.send(
                self._encode(
                    vsn,
                    {
                        "join_ref": msg.get("join_ref"),
                        "ref": None,
                        "topic": topic,
                        "event": "system",
                        "payload": {
                            "status": "ok",
                            "extension": "system",
                            "message": "Subscribed to PostgreSQL",
                            "channel": topic,
                        },
                    },
                )
            )
        elif event == "access_token":
            self.access_tokens.append(str(payload.get("access_token")))
            await self._reply(ws, vsn, msg, {"status": "ok", "response": {}})
        elif event == "phx_leave":
            members = self._members.get(topic, [])
            members[:] = [m for m in members if m[0] is not ws]
            await self._reply(ws, vsn, msg, {"status": "ok", "response": {}})
        else:
            await self._reply(ws, vsn, msg, {"status": "ok", "response": {}})

    # -- what a test does -------------------------------------------------------------------

    def subscribers(self, topic: str) -> int:
        """How many sockets have joined `topic` (Realtime's channel topic, `realtime:...`)."""
        return len(self._members.get(topic, []))

    def broadcast(self, topic: str, event: str, payload: dict[str, Any]) -> int:
        """Deliver a broadcast (as realtime.send's) to every member of `topic`; returns how
        many it reached."""

        async def send() -> int:
            sent = 0
            for ws, vsn, join_ref in list(self._members.get(topic, [])):
                msg = {
                    "join_ref": join_ref,
                    "ref": None,
                    "topic": topic,
                    "event": "broadcast",
                    "payload": {"type": "broadcast", "event": event, "payload": payload},
                }
                await ws.send(self._encode(vsn, msg))
                sent += 1
            return sent

        return asyncio.run_coroutine_threadsafe(send(), self._loop).result(10)
