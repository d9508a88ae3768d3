"""Benchmarks of the live system that run real processes on this machine and judge the result.

:mod:`.switch` measures one live switch (with :mod:`.switch_worker`, its worker processes)
against its floors and against checkpoint-and-restart, and checks it bit for bit; :mod:`.chaos`
kills workers of running jobs at random points and judges every recovery; :mod:`.fuzz` sends a
live, training agent thousands of generated requests and judges its answers and its training
(``benchmarks/agent_fuzz.py``). The ``dynatrain bench`` commands (``dynatrain.cli.bench``)
only parse arguments and print these results.
"""
