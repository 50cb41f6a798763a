"""The official MCP Python SDK against replicas of one gateway behind a round-robin proxy
(tests/replicas.rs starts them and the proxy, then runs this).

Usage: replicas.py URL
Over streamable HTTP at URL: initialize, tools/list, three calls with 2 MB of output and
progress notifications, every page of one kept output (read through whichever replica the
proxy picks), a search, six calls of one session (one runner, on the caller's home replica);
then three calls cancelled by the SDK at protocol 2025-11-25 (it sends
`notifications/cancelled`, which the proxy takes to another replica than the call's) and three
at 2026-07-28 (it aborts the call's POST), each of whose commands must stop; the SDK must not
warn. Exits 1 with the reason on the first failure.
"""

import json as _json
import logging
import sys

import anyio
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.seen = []

    def emit(self, record):
        self.seen.append(record.getMessage())


SDK_WARNINGS = Warnings()
logging.getLogger("mcp").addHandler(SDK_WARNINGS)

MARK = "\n[mcp-run: page ends here; next page: "


def check(cond, what):
    if not cond:
        raise SystemExit(f"replicas (python sdk): {what}")


async def main(url):
    async with streamable_http_client(url) as (read, write, *_):
        async with ClientSession(read, write) as session:
            init = await session.initialize()
            check(init.server_info.name, "no server name")
            tools = (await session.list_tools()).tools
            check(any(t.name == "run_network_tool" for t in tools), "no run_network_tool")
            uris = []
            for i in range(3):
                seen = []

                async def progress(progress, total, message):
                    seen.append(message or "")

                r = await session.call_tool(
                    "run_network_tool",
                    {"executable": "sh",
                     "args": ["-c", f"echo compiling step{i}; sleep 2.5; seq 1 300000"]},
                    progress_callback=progress,
                )
                check(not r.is_error, f"call {i} failed: {r}")
                o = r.structured_content["outputs"][0]
                full = o["full_output"]
                check(full["stdout_bytes"] == 1988895 + 16, f"call {i}: {full}")
                check(any(f"compiling step{i}" in m for m in seen), f"call {i}: progress {seen}")
                uris.append(full["stdout_uri"])
            check(len({u.split("/")[3][:8] for u in uris}) == 3,
                  f"three calls did not land on three replicas: {uris}")
            uri, whole, pages = uris[0], [], 0
            while True:
                r = await session.read_resource(uri)
                text = r.contents[0].text
                pages += 1
                if MARK in text:
                    body, rest = text.rsplit(MARK, 1)
                    whole.append(body)
                    uri = rest.strip().rstrip("]")
                else:
                    whole.append(text)
                    break
                check(pages < 200, "too many pages")
            expected = "compiling step0\n" + "".join(f"{n}\n" for n in range(1, 300001))
            check("".join(whole) == expected, f"the {pages} pages differ from the output")
            r = await session.read_resource(uris[2] + "?grep=%5E29999%24")
            check(r.contents[0].text == "30000:29999\n", f"grep: {r.contents[0].text!r}")
            # Six calls of one session, each through whichever replica the proxy picks: all
            # reach the one runner on the caller's home replica (its directory keeps the count).
            ppids = set()
            for n in range(1, 7):
                r = await session.call_tool(
                    "run_network_tool",
                    {"executable": "sh", "session": "sdk",
                     "args": ["-c", "echo x >> calls; wc -l < calls; echo $PPID"]},
                )
                check(not r.is_error, f"session call {n} failed: {r}")
                o = r.structured_content["outputs"][0]
                count, ppid = o["stdout"].split()
                check(count == str(n), f"session call {n} saw {count} earlier calls: {o}")
                ppids.add(ppid)
            check(len(ppids) == 1, f"the session's calls ran on {ppids}")
            # The session is listed, and ended, through any replica.
            for _ in range(3):
                r = await session.read_resource("mcp-run://sessions")
                names = [x["name"] for x in _json.loads(r.contents[0].text)["sessions"]]
                check(names == ["sdk"], f"mcp-run://sessions lists {names}")
            r = await session.call_tool("end_session", {"name": "sdk"})
            check(not r.is_error, f"end_session failed: {r}")
            for _ in range(3):
                r = await session.read_resource("mcp-run://sessions")
                names = [x["name"] for x in _json.loads(r.contents[0].text)["sessions"]]
                check(names == [], f"after end_session, mcp-run://sessions lists {names}")
            r = await session.call_tool(
                "run_network_tool",
                {"executable": "sh", "session": "sdk",
                 "args": ["-c", "echo x >> calls; wc -l < calls"]},
            )
            count = r.structured_content["outputs"][0]["stdout"].strip()
            check(count == "1", f"after end_session the session kept its runner: {count}")
    await cancel(url, modern=False)
    await cancel(url, modern=True)
    check(not SDK_WARNINGS.seen, f"the SDK warned: {SDK_WARNINGS.seen}")
    print(f"replicas (python sdk): ok ({pages} pages)")


async def cancel(url, modern):
    """A cancelled call stops its command on whichever replica runs it (a session call: on
    the caller's home, relayed when the proxy picked another replica). At protocol 2025-11-25
    (`initialize`) the SDK sends `notifications/cancelled` and keeps the call's stream open;
    at 2026-07-28 (no initialize: `server/discover`) it aborts the call's POST."""
    import os
    import tempfile
    import time

    pidfile = os.path.join(tempfile.mkdtemp(), "pid")
    async with streamable_http_client(url) as (read, write, *_):
        async with ClientSession(read, write) as session:
            if modern:
                d = await session.discover()
                check(d is not None, "no discover result")
            else:
                init = await session.initialize()
                check(init.protocol_version == "2025-11-25", f"negotiated {init.protocol_version}")
            for i in range(3):
                if os.path.exists(pidfile):
                    os.remove(pidfile)
                script = f"echo $$ > {pidfile}.tmp; mv {pidfile}.tmp {pidfile}; exec sleep 300"
                args = {"executable": "sh", "args": ["-c", script]}
                if i == 2:
                    args["session"] = "cancel-modern" if modern else "cancel"
                async with anyio.create_task_group() as tg:
                    tg.start_soon(session.call_tool, "run_network_tool", args)
                    with anyio.fail_after(30):
                        while not os.path.exists(pidfile):
                            await anyio.sleep(0.05)
                    tg.cancel_scope.cancel()
                pid = int(open(pidfile).read())
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline:
                    try:
                        os.kill(pid, 0)
                    except ProcessLookupError:
                        break
                    await anyio.sleep(0.1)
                else:
                    version = "2026-07-28" if modern else "2025-11-25"
                    raise SystemExit(f"replicas (python sdk): call {i} at {version} outlived its cancellation (pid {pid})")


if __name__ == "__main__":
    anyio.run(main, sys.argv[1])
