"""The official MCP Python SDK driving mcp-run (.ci/check.d/mcp-sdks.sh).

Usage: check.py GATEWAY_BIN URL [--slow]
Over streamable HTTP (URL, a running gateway) and over stdio (GATEWAY_BIN stdio): a small
command, a failing one, 10 MB of output, binary output, steps (stopping at the first failure,
and with continue_on_error), a session kept across calls and ended with end_session; with
--slow, a command that runs for over 60 s and must send progress notifications. Exits 1 with
the reason on the first failure.
"""

import logging
import sys
import time

import anyio
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client

BUDGET = 30_000


class Warnings(logging.Handler):
    """What the SDK itself complains about (e.g. "Session termination failed: 202"): a
    server the official client warns about is not done."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.seen = []

    def emit(self, record):
        self.seen.append(record.getMessage())


SDK_WARNINGS = Warnings()
logging.getLogger("mcp").addHandler(SDK_WARNINGS)


def check(cond, what):
    if not cond:
        raise SystemExit(f"mcp-sdks (python): {what}")


def structured(r):
    check(r.structured_content is not None, "no structuredContent")
    return r.structured_content["outputs"][0]


async def read_text(session, uri):
    r = await session.read_resource(uri)
    return r.contents[0].text


async def exercise(session, where, slow):
    await session.initialize()
    tools = (await session.list_tools()).tools
    check(any(t.name == "run_network_tool" for t in tools), f"{where}: no run_network_tool")

    r = await session.call_tool("run_network_tool", {"executable": "echo", "args": ["hello"]})
    check(not r.is_error, f"{where}: small command failed: {r}")
    check(structured(r)["stdout"] == "hello\n", f"{where}: small stdout {structured(r)}")

    r = await session.call_tool(
        "run_network_tool", {"executable": "sh", "args": ["-c", "echo boom >&2; exit 3"]}
    )
    check(r.is_error, f"{where}: a failing command is not isError")
    check(structured(r)["exit_code"] == 3, f"{where}: exit code {structured(r)}")
    check(structured(r)["stderr"] == "boom\n", f"{where}: stderr {structured(r)}")

    # 10 MB: the SDK's SSE event limit (1 MiB) must not be reached, and the rest is a read away.
    r = await session.call_tool(
        "run_network_tool",
        {"executable": "sh", "args": ["-c", "head -c 10485760 /dev/zero | tr '\\0' y; echo; echo END"]},
    )
    o = structured(r)
    check(not r.is_error, f"{where}: 10 MB failed")
    check(len(o["stdout"]) <= BUDGET, f"{where}: 10 MB result carries {len(o['stdout'])} chars")
    check(o["stdout"].endswith("END\n"), f"{where}: the tail of 10 MB is missing")
    full = o["full_output"]
    check(full["stdout_bytes"] == 10485765, f"{where}: full output size {full}")
    page = await read_text(session, full["stdout_uri"] + "?bytes=5000000-")
    check(page.startswith("yyyy") and "next page: " in page, f"{where}: page {page[:100]!r}")
    tail = await read_text(session, full["stdout_uri"] + "?grep=END")
    check(tail == "2:END\n", f"{where}: grep {tail!r}")

    # Binary output: NUL and invalid UTF-8 reach the client as text, within the budget.
    r = await session.call_tool(
        "run_network_tool", {"executable": "sh", "args": ["-c", "head -c 200000 /dev/urandom"]}
    )
    check(not r.is_error, f"{where}: binary failed")
    check(len(structured(r)["stdout"]) <= BUDGET, f"{where}: binary over budget")

    # Steps: one runner, one output per step that ran, stopped at the first failure.
    r = await session.call_tool(
        "run_network_tool",
        {"steps": [
            {"executable": "sh", "args": ["-c", "echo built > out"]},
            {"executable": "sh", "args": ["-c", "cat out; exit 4"]},
            {"executable": "echo", "args": ["never"]},
        ]},
    )
    s = r.structured_content
    check(r.is_error, f"{where}: failing steps are not isError")
    check(len(s["outputs"]) == 2, f"{where}: steps ran on after a failure: {s['outputs']}")
    check(s["outputs"][1]["stdout"] == "built\n", f"{where}: steps do not share a runner: {s}")
    check(s["outputs"][1]["exit_code"] == 4, f"{where}: step exit {s['outputs'][1]}")
    check("### Step 2:" in r.content[0].text, f"{where}: no Step 2 section")
    r = await session.call_tool(
        "run_network_tool",
        {"steps": [{"executable": "false"}, {"executable": "echo", "args": ["after"]}],
         "continue_on_error": True},
    )
    s = r.structured_content
    check(len(s["outputs"]) == 2 and s["outputs"][1]["stdout"] == "after\n",
          f"{where}: continue_on_error: {s}")
    check(s["success"] is False, f"{where}: continue_on_error hid the failure")

    # A session: state kept between calls, then ended.
    name = "sdk-" + where.split()[0].lower()
    await session.call_tool(
        "run_network_tool",
        {"executable": "sh", "args": ["-c", "echo warm > state"], "session": name},
    )
    r = await session.call_tool(
        "run_network_tool", {"executable": "cat", "args": ["state"], "session": name}
    )
    check(structured(r)["stdout"] == "warm\n", f"{where}: the session lost its state: {r}")
    check(r.structured_content["context"]["session_call"] == 2, f"{where}: session_call")
    r = await session.call_tool("end_session", {"name": name})
    check(not r.is_error, f"{where}: end_session failed: {r}")

    if slow:
        seen = []

        async def progress(progress, total, message):
            seen.append(message or "")

        started = time.monotonic()
        r = await session.call_tool(
            "run_network_tool",
            {"executable": "sh", "args": ["-c", "for i in $(seq 1 62); do echo tick $i; sleep 1; done"]},
            read_timeout_seconds=120,
            progress_callback=progress,
        )
        check(not r.is_error, f"{where}: slow command failed")
        check(time.monotonic() - started > 60, f"{where}: slow command was not slow")
        check(len(seen) >= 30, f"{where}: {len(seen)} progress notifications in 60 s")
        check(any("tick" in m for m in seen), f"{where}: progress without output: {seen[:3]}")
    print(f"mcp-sdks (python): {where}: ok")


async def main():
    binary, url = sys.argv[1], sys.argv[2]
    slow = "--slow" in sys.argv[3:]
    async with streamable_http_client(url) as (read, write):
        async with ClientSession(read, write) as session:
            await exercise(session, "streamable HTTP", slow)
    check(not SDK_WARNINGS.seen, f"streamable HTTP: the SDK warned: {SDK_WARNINGS.seen}")
    params = StdioServerParameters(command=binary, args=["stdio"])
    async with stdio_client(params) as (read, write):
        async with ClientSession(read, write) as session:
            await exercise(session, "stdio", False)
    check(not SDK_WARNINGS.seen, f"stdio: the SDK warned: {SDK_WARNINGS.seen}")


anyio.run(main)
