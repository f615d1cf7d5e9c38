"""A tensor-parallel rank other than 0: connects to rank 0, builds its shard of the model, then runs
each step rank 0 sends until it says stop, or until its connection to rank 0 breaks."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.model_source import ModelNotFoundError, resolve_model_path
from lmdeploy.pytorch.distributed.cpu_affinity import bind_rank, rank_cpus
from lmdeploy.pytorch.distributed.rendezvous import connect, join_store, report_error
from lmdeploy.pytorch.engine.runner_builder import build_runner
from lmdeploy.pytorch.kernels import cpu as cpu_kernels

logger = logging.getLogger('lmdeploy')


@dataclass
class WorkerSpec:
    """What a worker needs to know: its rank, where rank 0's store is, the address other ranks reach it
    at, its rank among the ranks on its machine (whose CPUs they share), its device, the model (the path
    rank 0 was given, absolute; None: the default model) and the engine's settings."""

    rank: int
    world_size: int
    store_host: str
    store_port: int
    host: str
    local_rank: int
    local_world_size: int
    device: str
    model_path: str | None
    config: PytorchEngineConfig


def local_model_dir(spec: WorkerSpec) -> str:
    """The model's folder on this worker's machine: the path rank 0 was given, resolved here (a .gguf
    file is converted into this machine's cache on first use); raises :class:`ModelNotFoundError` naming
    the path and this machine when it is not there."""
    try:
        return resolve_model_path(spec.model_path)
    except FileNotFoundError as exc:
        raise ModelNotFoundError(f'rank {spec.rank} on {spec.host}: {exc} (every machine needs the model at the '
                                 'same path)') from exc


def run_worker(spec: WorkerSpec) -> None:
    """Serves as rank ``spec.rank`` until rank 0 stops the group; raises what failed, after leaving it in
    the store for rank 0."""
    device = torch.device(spec.device)
    if device.type == 'cpu':
        bind_rank(rank_cpus(spec.local_rank, spec.local_world_size), spec.config.num_threads)
        cpu_kernels.native()
    else:
        torch.cuda.set_device(device)
    store = join_store(spec.store_host, spec.store_port, spec.world_size)
    group = None
    try:
        model_dir = local_model_dir(spec)
        group = connect(store, spec.rank, spec.world_size, spec.host, device)
        _, _, runner = build_runner(model_dir, spec.config, device, group, show_progress=False)
        runner.serve()
    except BaseException as exc:
        report_error(store, spec.rank, exc)
        raise
    finally:
        if group is not None:
            group.shutdown()
