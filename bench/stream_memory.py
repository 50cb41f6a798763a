#!/usr/bin/env python3
"""Memory a stalled `/raw` stream costs the gateway (issue 15.8). Loopback only, bounded.

For each of --rounds rounds: start a fresh gateway, read its RSS with no stream open (the
same-run baseline), open --streams streams of `yes` whose client reads the `started` event
and then nothing, wait until the RSS stops growing, read it again. Reports the median and
range of (RSS with streams - baseline) / streams.

    python3 bench/stream_memory.py --bin target/debug/mcp-run --streams 100 --rounds 3
"""

import argparse
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def rss_kib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def one_round(binary, streams):
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(f"limits:\n  max_concurrent_executions: {streams + 8}\n")
    gw = subprocess.Popen([binary, "serve", "--listen", "127.0.0.1:0", "--config", f.name],
                          stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        addr = None
        for line in gw.stderr:
            m = re.search(r"addr=(\S+)", line)
            if m and "listening" in line:
                host, port = m.group(1).rsplit(":", 1)
                addr = (host, int(port))
                break
        if addr is None:
            sys.exit("the gateway did not start")
        time.sleep(1)
        base = rss_kib(gw.pid)
        body = b'{"executable":"yes","timeout_secs":300}'
        socks = []
        for _ in range(streams):
            s = socket.create_connection(addr)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.sendall(b"POST /raw HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                      + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            s.recv(200)
            socks.append(s)
        last, stable = 0, 0
        while stable < 5:
            time.sleep(0.5)
            now = rss_kib(gw.pid)
            stable = stable + 1 if abs(now - last) < 256 else 0
            last = now
        for s in socks:
            s.close()
        return base, last
    finally:
        gw.kill()
        gw.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/debug/mcp-run")
    ap.add_argument("--streams", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    per = []
    for i in range(a.rounds):
        base, loaded = one_round(a.bin, a.streams)
        per.append((loaded - base) / a.streams)
        print(f"round {i + 1}: baseline {base / 1024:.1f} MiB, with {a.streams} stalled streams "
              f"{loaded / 1024:.1f} MiB, {per[-1]:.0f} KiB per stream")
    print(f"per stalled stream: median {statistics.median(per):.0f} KiB "
          f"(range {min(per):.0f}-{max(per):.0f} KiB over {a.rounds} rounds)")


if __name__ == "__main__":
    main()
