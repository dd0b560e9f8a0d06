"""The multi-host drills of tests/test_multihost.py, with a timeline: two gateways (127.0.1.1,
127.0.1.2), two engines (127.0.2.1, 127.0.2.2), Redis (127.0.3.2) and dnsmasq (127.0.3.1), each
"host" on a loopback address of its own, a load client spreading streams over the gateways that
answer /readyz.

    python benchmarks/multihost.py --engines http://127.0.2.1:8101,http://127.0.2.2:8102

The engines are running vLLM engines serving the demo model, each on its own address (e.g.
`yieldgate up` with `fleet.demo_hosts = ["127.0.2.1", "127.0.2.2"]`). Prints each drill's
timeline and writes benchmarks/results/multihost.json (through benchmarks/harness.py, every run
kept): requests, failures, connections refused and re-sent to the other gateway (failures the
client's re-send avoided), time until a new engine takes requests, time for a removed one to leave,
drain time of a SIGTERMed gateway.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import harness  # noqa: E402  benchmarks/harness.py, beside this script

from multihost import (Engine, Fleet, drill_engines, drill_redis, drill_sigkill, drill_sigterm,  # noqa: E402
                       failures, reconcile, until)
from yieldgate.serving.demo_model import ensure_demo_model  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


MEASURES = ["gateway/", "cache/", "serving/", "pricing/", "tests/multihost.py", "benchmarks/multihost.py"]


def drills_once(engines: list[Engine], port_base: int) -> dict:
    """The four drills on a fleet of their own; each drill's summary, reconciled with the ledger."""
    drills = {}
    with tempfile.TemporaryDirectory(prefix="yg-multihost-") as work:
        fleet = Fleet(Path(work), engines, "demo", ensure_demo_model(), port_base)
        try:
            fleet.start(engines)
            for i in range(2):
                until(lambda: fleet.serving(i) == {e.name for e in engines}, f"gateway {i + 1} routes to both")
            for name, run in (("dns", lambda: drill_engines(fleet, *engines)),
                              ("sigterm", lambda: drill_sigterm(fleet, 0)),
                              ("sigkill", lambda: drill_sigkill(fleet, 1)),
                              ("redis", lambda: drill_redis(fleet))):
                drill = run()
                if name != "sigkill":
                    assert failures(drill.served) == [], [s.detail for s in failures(drill.served)]
                reconcile(fleet, drill.served, timeout_s=90)
                summary = drill.summary()
                summary["reconciled"] = True
                drills[name] = {k: v for k, v in summary.items() if not k.endswith("_at")}
                print(f"\n== {name}: {summary['requests']} requests, {summary['failed']} failed, "
                      f"{summary['refused_and_resent']} refused and re-sent")
                for line in summary["timeline"]:
                    print("  " + line)
        finally:
            fleet.stop()
    return drills


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", required=True, help="two engine URLs, comma-separated")
    parser.add_argument("--port-base", type=int, default=int(os.environ.get("YIELDGATE_TEST_PORT_BASE", "18000")))
    parser.add_argument("--runs", type=int, default=harness.DEFAULT_RUNS, help="the four drills, this many times")
    parser.add_argument("--out", default=str(harness.RESULTS / "multihost.json"))
    args = parser.parse_args()
    engines = []
    for url in args.engines.split(","):
        address, port = url.removeprefix("http://").rsplit(":", 1)
        engines.append(Engine(address, int(port)))
    rec = harness.Recording("multihost", MEASURES, out=Path(args.out))
    runs = [{"round": i, "drills": drills_once(engines, args.port_base)} for i in range(args.runs)]
    totals = [{k: sum(d[k] for d in r["drills"].values()) for k in ("requests", "failed", "refused_and_resent")}
              for r in runs]
    summary = {k: harness.summarize(t[k] for t in totals) for k in totals[0]}
    for drill, key in (("dns", "admit_s"), ("dns", "leave_s"), ("sigterm", "drain_s")):
        summary[f"{drill}_{key}"] = harness.summarize(r["drills"][drill][key] for r in runs)
    summary["sigkill_failed"] = harness.summarize(r["drills"]["sigkill"]["failed"] for r in runs)
    rec.write(runs=runs, summary=summary,
              setup="4 clients, streamed chat completions of 64 tokens, spread over the ready gateways")


if __name__ == "__main__":
    main()
