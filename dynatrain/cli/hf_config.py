"""``dynatrain hf-config DIR``: a Hugging Face checkpoint's config, ready to inline in a job.

On a cluster the checkpoint directory named by ``spec.model.hf`` lives on the workers' volume,
which the operator does not mount, yet the operator plans layouts from the model's shapes. This
command reads ``DIR/config.json``, checks that DynaTrain supports it (the same check the workers
make), and prints the ``spec.model`` block with the config inline as ``hfConfig``.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml


def register(sub) -> None:
    p = sub.add_parser(
        "hf-config", help="print a Hugging Face checkpoint's spec.model block for a cluster job",
        description="Read DIR/config.json, check that DynaTrain supports the model, and print "
        "the job manifest's spec.model block with the config inline (spec.model.hfConfig), "
        "so the operator can plan without reading the workers' volume.",
        epilog="example: dynatrain hf-config /models/llama --as /models/llama")
    p.add_argument("dir", metavar="DIR", help="checkpoint directory with config.json")
    p.add_argument("--as", dest="path", metavar="PATH",
                   help="the directory's path inside the worker pods (default: DIR)")
    p.set_defaults(func=run_hf_config)


def run_hf_config(args) -> int:
    from dynatrain.vps.hf import model_from_hf

    model = model_from_hf(args.dir)                 # refuses what the workers would refuse
    config = json.loads((Path(args.dir) / "config.json").read_text())
    print(f"# {model.name}: {model.num_params:,} parameters ({config.get('architectures')})")
    print(yaml.safe_dump({"model": {"hf": args.path or args.dir, "hfConfig": config}},
                         sort_keys=False), end="")
    return 0
