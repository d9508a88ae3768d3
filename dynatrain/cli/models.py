"""``dynatrain models``: list the model presets with their sizes, as a table or one JSON object."""

from __future__ import annotations

import json

from dynatrain.cli.plan import fmt_bytes
from dynatrain.vps.mapping import model_states, state_bytes
from dynatrain.vps.presets import PRESETS


def register(sub) -> None:
    m = sub.add_parser("models", help="list the model presets",
                       description="List the model presets with their sizes.")
    m.add_argument("--json", action="store_true", help="print one JSON object")
    m.set_defaults(func=run_models)


def run_models(args) -> int:
    rows = [{"name": m.name, "arch": m.arch, "params": m.num_params, "layers": m.num_layers,
             "experts": m.num_experts, "dtype": m.dtype, "state_bytes": state_bytes(m),
             "states": list(model_states(m)), "description": m.description}
            for m in PRESETS.values()]
    if args.json:
        print(json.dumps({"models": rows}))
        return 0
    print(f"{'model':<18}{'params':>18}{'layers':>8}{'experts':>9}  {'dtype':<9}"
          f"{'state/replica':>14}  description")
    for r in rows:
        print(f"{r['name']:<18}{r['params']:>18,}{r['layers']:>8}{r['experts']:>9}  "
              f"{r['dtype']:<9}{fmt_bytes(r['state_bytes']):>14}  {r['description']}")
    return 0
