"""The fork server that ranks and local workers start from (:mod:`dynatrain.trainer.processes`):
what a forked worker still imports itself."""

from __future__ import annotations

import sys

from dynatrain.trainer import processes


def _new_libraries(index: int, results) -> None:
    before = set(sys.modules)
    import dynatrain.agent.worker  # noqa: F401  (the closure a local or pod worker imports)
    new = {name.split(".")[0] for name in set(sys.modules) - before}
    results.put(sorted(new - set(sys.stdlib_module_names) - {"dynatrain"}))


def test_a_forked_worker_imports_no_library_that_the_server_could_have_preloaded():
    # Every third-party library `dynatrain worker` imports is in PRELOAD, so hundreds of forked
    # workers do not each pay for it (cryptography, grpc & co. took 0.25 s of CPU per worker);
    # only this project's modules are imported in the worker (see the module's docstring).
    results = processes.context("forkserver").Queue()
    ranks = processes.start_ranks(_new_libraries, args=(results,), nprocs=1,
                                  method="forkserver")
    try:
        assert results.get(timeout=120) == []
    finally:
        ranks.join(60)
