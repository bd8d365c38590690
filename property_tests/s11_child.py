"""The S11 SIGKILL child: one worker process that runs a generated flow until the test
kills it (``python -m property_tests.s11_child DB LOG SPEC RUN TENANT MODE``).

It prints ``ready`` once its store is open (the parent kills it from then on, at a
random time), starts the run (idempotent by id), drives it until it ends or waits (an
in-doubt effect the parent resolves from the provider's log), prints ``done STATUS``
and exits. Its provider appends every raw delivery to ``LOG``.
"""

from __future__ import annotations

import sys

from onceonly.checkpoint import Store
from onceonly.ledger import InFlightPolicy, Keyring, Ledger
from onceonly.runtime import Runtime
from property_tests.s11_flows import FileProvider, FlowSpec, build_flows, flow_name
from tests.ledger_support import K1


def main(argv: list[str]) -> int:
    db_url, log, spec_json, run_id, tenant, mode = argv
    spec = FlowSpec.from_json(spec_json)
    store = Store.open(db_url, durability=mode)
    # One stable worker name across incarnations: a predecessor's unfinished claim is in
    # doubt at once (never sent again on a guess).
    ledger = Ledger(store, Keyring([K1]), owner="s11-child", in_flight=InFlightPolicy(wait_s=0))
    provider = FileProvider(log, delay_s=0.02)
    rt = Runtime(store, ledger, build_flows(spec, provider), owner="s11-child", lease_s=5.0)
    print("ready", flush=True)
    rt.start(flow_name(tenant), {"lineage": run_id}, run_id=run_id)
    run = rt.drive(run_id, max_steps=200)
    ledger.close()
    store.close()
    print(f"done {run.status.value}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
