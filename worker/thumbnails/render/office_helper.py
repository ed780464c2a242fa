"""The LibreOffice side of `OfficeConverter`: run by a Python that has LibreOffice's `uno` module
(Debian's python3, or LibreOffice's own), never imported by thumbq.

Starts one headless soffice with a private profile, connects to it over a named pipe, then
converts one document per request until its standard input closes. Requests and replies are JSON
lines on stdin/stdout. Only the standard library and `uno` may be imported here.

Usage: python office_helper.py SOFFICE PROFILE_DIR PIPE_NAME MEMORY_LIMIT_MB
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time

CONNECT_TIMEOUT_S = 60.0
# A profile that never runs a macro, never updates links and never fetches an image from a
# location the document names (LibreOffice's own switches for untrusted documents).
_REGISTRY = """<?xml version="1.0" encoding="UTF-8"?>
<oor:items xmlns:oor="http://openoffice.org/2001/registry"
 xmlns:xs="http://www.w3.org/2001/XMLSchema" xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance">
<item oor:path="/org.openoffice.Office.Common/Security/Scripting">
 <prop oor:name="MacroSecurityLevel" oor:op="fuse"><value>3</value></prop></item>
<item oor:path="/org.openoffice.Office.Common/Security/Scripting">
 <prop oor:name="DisableMacrosExecution" oor:op="fuse"><value>true</value></prop></item>
<item oor:path="/org.openoffice.Office.Common/Security/Scripting">
 <prop oor:name="BlockUntrustedRefererLinks" oor:op="fuse"><value>true</value></prop></item>
<item oor:path="/org.openoffice.Office.Common/Misc">
 <prop oor:name="FirstRun" oor:op="fuse"><value>false</value></prop></item>
<item oor:path="/org.openoffice.Office.Common/Misc">
 <prop oor:name="UseOpenCL" oor:op="fuse"><value>false</value></prop></item>
<item oor:path="/org.openoffice.Office.Common/Misc">
 <prop oor:name="UseLocking" oor:op="fuse"><value>false</value></prop></item>
</oor:items>
"""

_soffice: subprocess.Popen[bytes] | None = None


def main() -> None:
    soffice, profile, pipe_name, memory_mb = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    _die_with_parent()
    signal.signal(signal.SIGTERM, lambda *_: _stop(0))
    import uno
    from com.sun.star.beans import PropertyValue

    def prop(name: str, value: object) -> PropertyValue:
        p = PropertyValue()
        p.Name = name
        p.Value = value
        return p

    user = os.path.join(profile, "user")
    os.makedirs(user, exist_ok=True)
    with open(os.path.join(user, "registrymodifications.xcu"), "w") as f:
        f.write(_REGISTRY)
    limit = int(memory_mb) * 1024 * 1024

    def limit_memory() -> None:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))

    global _soffice
    _soffice = subprocess.Popen(
        [
            soffice,
            "-env:UserInstallation=" + uno.systemPathToFileUrl(profile),
            "--headless",
            "--invisible",
            "--norestore",
            "--nologo",
            "--nodefault",
            "--nolockcheck",
            f"--accept=pipe,name={pipe_name};urp;StarOffice.ComponentContext",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=limit_memory,
    )
    local = uno.getComponentContext()
    resolver = local.ServiceManager.createInstanceWithContext(
        "com.sun.star.bridge.UnoUrlResolver", local
    )
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            ctx = resolver.resolve(f"uno:pipe,name={pipe_name};urp;StarOffice.ComponentContext")
            break
        except Exception:
            if _soffice.poll() is not None or time.monotonic() > deadline:
                _reply({"ok": False, "error": "LibreOffice did not start"})
                _stop(1)
            time.sleep(0.05)
    desktop = ctx.ServiceManager.createInstanceWithContext("com.sun.star.frame.Desktop", ctx)
    _reply({"ok": True, "ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        try:
            doc = desktop.loadComponentFromURL(
                uno.systemPathToFileUrl(request["in"]),
                "_blank",
                0,
                (
                    prop("Hidden", True),
                    prop("ReadOnly", True),
                    prop("MacroExecutionMode", 0),  # NEVER_EXECUTE
                    prop("UpdateDocMode", 0),  # NO_UPDATE: linked content stays as saved
                    prop("RepairPackage", False),
                ),
            )
            if doc is None:
                raise RuntimeError("LibreOffice cannot open this document")
            try:
                filter_data = uno.Any(
                    "[]com.sun.star.beans.PropertyValue",
                    (prop("PageRange", f"1-{max(1, int(request.get('pages', 1)))}"),),
                )
                doc.storeToURL(
                    uno.systemPathToFileUrl(request["out"]),
                    (prop("FilterName", request["filter"]), prop("FilterData", filter_data)),
                )
            finally:
                with contextlib.suppress(Exception):
                    doc.close(True)
            _reply({"ok": True})
        except Exception as exc:
            message = getattr(exc, "Message", "") or str(exc) or type(exc).__name__
            # soffice died on this document (a crash, or its memory limit): say so and stop,
            # so that the next document gets a fresh one rather than a dead connection.
            crashed = _soffice.poll() is not None
            _reply({"ok": False, "error": message[:300], "crashed": crashed})
            if crashed:
                _stop(1)
    _stop(0)


def _reply(message: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _stop(code: int) -> None:
    """Kill soffice's whole process group (oosplash and soffice.bin), then exit."""
    if _soffice is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(_soffice.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            _soffice.wait(5)
    os._exit(code)


def _die_with_parent() -> None:
    """Stop (killing soffice) as soon as the worker is gone, even in the middle of a conversion.

    Not PR_SET_PDEATHSIG: it fires when the *thread* that started this process ends, and the
    worker starts it from a batch's worker thread while the converter outlives that batch."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.25)
        _stop(0)

    threading.Thread(target=watch, daemon=True).start()


if __name__ == "__main__":
    main()
