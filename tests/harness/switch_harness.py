"""A worker for failure tests: a switch in which one device dies abruptly mid-transfer."""

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from dynatrain.trainer.groups import build_groups
from dynatrain.trainer.switch import switch
from dynatrain.trainer.trainer import Trainer
from dynatrain.vps.generations import DeviceManager
from dynatrain.vps.layout import bind
from dynatrain.vps.transition import TransitionConfig, TransitionError


def fault_worker(device, world, port, old_cfg, new_cfg, new_layout, victim, timeout_s, results,
                 mode="exit"):
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                          timeout=timedelta(seconds=60))
    mgr = DeviceManager(store, device, timeout=timedelta(seconds=timeout_s))
    model = old_cfg.model
    old_layout = old_cfg.layout.with_devices(range(old_cfg.layout.world))
    holder = []
    if device < old_cfg.layout.world:
        holder.append(Trainer(old_cfg, build_groups(bind(old_layout, model), device,
                                                    mgr.group_factory(0, old_layout))))
    bound = bind(new_layout, model)
    prepared = mgr.prepare(1, model, old_layout, new_layout, staging_bytes=1 << 20,
                           build_extra=lambda r: build_groups(bound, r,
                                                              mgr.group_factory(1, new_layout))
                           ).result(timeout=60)
    if holder:
        holder[0].train_step()
    if device == victim:
        os.environ["DYNATRAIN_FAULT"] = f"device:{device},round:0,mode:{mode}"
    t0 = time.perf_counter()
    try:
        # "exit" sends the tiny model's regions direct (unpacked), "hang" packs them: a lost
        # peer is caught on both paths.
        switch(holder, prepared, new_cfg, device,
               config=TransitionConfig(staging_bytes=1 << 20,
                                       direct_bytes=1024 if mode == "exit" else 1 << 20,
                                       timeout=timedelta(seconds=timeout_s)))
        results.put(("completed", device, "", time.perf_counter() - t0))
    except TransitionError as e:
        results.put(("TransitionError", device, str(e), time.perf_counter() - t0))
    except Exception as e:  # any other failure is a test failure: report it by name
        results.put((type(e).__name__, device, str(e), time.perf_counter() - t0))
    results.close()
    results.join_thread()  # flush the report before the abrupt exit below
    os._exit(0)  # do not wait in process-group teardown with a dead peer
