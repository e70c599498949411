"""Benchmark of the tool executor over real HTTP.

Starts `rstar serve tool-executor` on a free loopback port (or uses --url), then
1. for each workload — trivial `print(1+1)`, a sympy call `sympy.factorint(2**64-1)`, and a
   50 ms CPU loop — and each concurrency (16 and 256 clients, each sending its next call as
   soon as the last one is answered, through ToolExecutorClient) runs for --seconds and reports
   completed calls/s, p50/p95/p99 latency (client-side, request to response) and errors
   (anything but status ok, including exceptions), and — when it started the service — the
   service's CPU ms per call (server + pool parents + children) and the calls/s that CPU cost
   allows on all cores: the machine is shared, so calls/s moves with the neighbours' load;
   CPU per call much less;
2. submits a burst of --burst trivial calls at once through the batch API
   (ToolExecutorClient.execute_many) and reports the time to drain, completed, lost (no
   result) and errors (a result other than ok).

The last line is one JSON object with every figure; the headline keys are
trivial_c256_per_s, trivial_c256_errors, trivial_c16_p99_ms, burst_completed, burst_lost,
burst_errors, burst_s. `--quick` runs shorter phases and a 5,000-call burst.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.tool_executor.client import ToolExecutorClient  # noqa: E402
from services.tool_executor.testing import running_server  # noqa: E402

WORKLOADS = {
    "trivial": "print(1+1)",
    "sympy": "import sympy\nprint(sympy.factorint(2**64 - 1))",
    "cpu50": "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.05:\n    pass\nprint('done')",
}


def pct(sorted_ms: list[float], q: float) -> float:
    if not sorted_ms:
        return float("nan")
    return round(sorted_ms[min(len(sorted_ms) - 1, int(q * len(sorted_ms)))], 2)


class RawHttpClient:
    """One keep-alive HTTP/1.1 connection per simulated client. The load generator shares the
    2 cores with the service, so it is kept lean (httpx costs ~3 ms of CPU per call here, more
    than the service itself); ToolExecutorClient is still exercised by the burst."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        self.writer.write(head.encode() + body)
        status_line = await self.reader.readline()
        length = 0
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                break
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        payload = await self.reader.readexactly(length)
        return int(status_line.split()[1]), payload

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def closed_loop(url: str, code: str, concurrency: int, seconds: float) -> dict:
    latencies: list[float] = []
    errors = 0
    stop_at = time.monotonic() + seconds
    parsed = httpx.URL(url)
    body = json.dumps({"code": code, "timeout_s": 10}).encode()

    async def one_client() -> None:
        nonlocal errors
        conn = RawHttpClient(parsed.host, parsed.port)
        try:
            while time.monotonic() < stop_at:
                t0 = time.perf_counter()
                try:
                    status, payload = await conn.post("/v1/execute", body)
                    if status != 200 or json.loads(payload)["status"] != "ok":
                        errors += 1
                except Exception:  # noqa: BLE001 - counted
                    errors += 1
                    conn.close()
                    conn = RawHttpClient(parsed.host, parsed.port)
                latencies.append((time.perf_counter() - t0) * 1000)
        finally:
            conn.close()

    t0 = time.monotonic()
    await asyncio.gather(*(one_client() for _ in range(concurrency)))
    elapsed = time.monotonic() - t0
    latencies.sort()
    completed = len(latencies) - errors
    return {
        "per_s": round(completed / elapsed, 1),
        "p50_ms": pct(latencies, 0.50),
        "p95_ms": pct(latencies, 0.95),
        "p99_ms": pct(latencies, 0.99),
        "errors": errors,
        "calls": len(latencies),
    }


async def burst(client: ToolExecutorClient, n: int) -> dict:
    t0 = time.monotonic()
    try:
        results = await client.execute_many(["print(1+1)"] * n)
    except Exception as exc:  # noqa: BLE001 - reported as lost
        print(f"burst failed: {exc!r}", file=sys.stderr)
        results = []
    elapsed = time.monotonic() - t0
    ok = sum(1 for r in results if r.status == "ok" and r.stdout == "2\n")
    for r in [r for r in results if not (r.status == "ok" and r.stdout == "2\n")][:5]:
        print(f"burst error: {r.model_dump()}", file=sys.stderr)
    return {"burst_s": round(elapsed, 2), "burst_completed": ok, "burst_lost": n - len(results), "burst_errors": len(results) - ok, "burst_per_s": round(ok / elapsed, 1)}


_CLK = os.sysconf("SC_CLK_TCK")


def service_cpu_s(pids: list[int]) -> float:
    """CPU seconds used so far by the service, its pool parents and their (reaped) children."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
    return total / _CLK


async def run(url: str, seconds: float, burst_n: int, workloads: list[str], concurrencies: list[int], pids: list[int] | None = None) -> dict:
    """`pids`: the service and its pool parents, when this script started them: then each
    phase also reports the service's CPU ms per call, a figure the other processes sharing
    the machine do not move much, and the calls/s it would allow on all cores."""
    figures: dict = {}
    async with ToolExecutorClient([url], max_connections=512) as client:
        for _ in range(50):  # warm up connections and pool parents
            await client.execute("print(0)")
        for name in workloads:
            for c in concurrencies:
                cpu0 = service_cpu_s(pids) if pids else 0.0
                r = await closed_loop(url, WORKLOADS[name], c, seconds)
                extra = ""
                if pids and r["calls"]:
                    r["service_cpu_ms_per_call"] = round((service_cpu_s(pids) - cpu0) * 1000 / r["calls"], 3)
                    r["cpu_bound_per_s"] = round((os.cpu_count() or 1) * 1000 / r["service_cpu_ms_per_call"], 1)
                    extra = f"  | service CPU {r['service_cpu_ms_per_call']:.2f} ms/call -> {r['cpu_bound_per_s']:.0f}/s on {os.cpu_count()} idle cores"
                print(f"{name:8s} c={c:<4d} {r['per_s']:8.1f}/s  p50 {r['p50_ms']:7.2f} ms  p95 {r['p95_ms']:7.2f} ms  p99 {r['p99_ms']:7.2f} ms  errors {r['errors']}  ({r['calls']} calls){extra}", flush=True)
                for k, v in r.items():
                    figures[f"{name}_c{c}_{k}"] = v
        if burst_n:
            b = await burst(client, burst_n)
            print(f"burst    n={burst_n}: drained in {b['burst_s']} s ({b['burst_per_s']}/s), completed {b['burst_completed']}, lost {b['burst_lost']}, errors {b['burst_errors']}", flush=True)
            figures.update(b)
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="use a running service instead of starting one")
    ap.add_argument("--seconds", type=float, default=8.0, help="duration of each closed-loop phase")
    ap.add_argument("--burst", type=int, default=45_000, help="calls in the batch burst (0: skip)")
    ap.add_argument("--workloads", default="trivial,sympy,cpu50")
    ap.add_argument("--concurrency", default="16,256")
    ap.add_argument("--quick", action="store_true", help="3 s phases, 5,000-call burst")
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for the started service (e.g. RSTAR_TOOL_EXECUTOR_WORKERS=4)")
    args = ap.parse_args()
    if args.quick:
        args.seconds, args.burst = 3.0, min(args.burst, 5000)
    plan = (args.seconds, args.burst, args.workloads.split(","), [int(c) for c in args.concurrency.split(",")])
    if args.url:
        figures = asyncio.run(run(args.url, *plan))  # no CPU figures for a remote service
    else:
        with running_server(dict(kv.split("=", 1) for kv in args.env)) as server:
            figures = asyncio.run(run(server.url, *plan, pids=[server.pid, *server.pool_parent_pids()]))
    figures["cpus"] = os.cpu_count()
    print("Headline: trivial calls/s and errors at 256 clients, trivial p99 at 16 clients, the batch burst (completed/lost/errors/seconds); all figures follow.")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
