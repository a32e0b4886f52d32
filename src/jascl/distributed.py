"""Multi-process training on torch.distributed (torchrun + DistributedDataParallel).

jascl does not launch or synchronise processes itself: ``jascl run --devices N``
starts ``torchrun`` (``torch.distributed.run``) with N processes on this machine,
and ``torchrun ... -m jascl run ...`` (or one ``torchrun`` per node under SLURM)
does the same across machines. Every process runs the whole protocol; within a
session each rank trains on its share of every global batch through
:class:`torch.nn.parallel.DistributedDataParallel`, and everything a result
depends on is reduced across ranks here (prototype sums, confusion matrices,
pseudo-label counters, the epoch loss). Only rank 0 writes files.

Outside a ``torchrun`` launch (``WORLD_SIZE`` unset or 1) every function here
is a no-op for a single process, so the same code path serves both.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from jascl.errors import ConfigError


def usable_cores() -> int:
    """The CPU cores this process may run on: its affinity mask (a container's cpuset, ``taskset``, a SLURM
    allocation), not the machine's count, which ``os.cpu_count()`` gives."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS and Windows have no affinity mask
        return os.cpu_count() or 1


def launched() -> bool:
    """True in a process started by torchrun with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def is_main() -> bool:
    """Rank 0 (or the only process): the one that writes files, logs and progress bars."""
    return rank() == 0


def init(device: str, init_method: str | None = None) -> str:
    """Join the process group torchrun set up; returns this rank's device name.

    Backend: NCCL when the ranks use CUDA devices, else gloo (CPU). With
    ``device`` "auto" or "cuda" each rank takes ``cuda:<LOCAL_RANK>``; a fixed
    ``cuda:K`` is refused, since every rank would share one GPU. ``init_method``:
    where the ranks meet (torch's ``init_method``, e.g. ``file://...``, with
    ``RANK`` and ``WORLD_SIZE`` from the environment); None: ``MASTER_ADDR`` and
    ``MASTER_PORT`` (``env://``).
    """
    if not launched():
        return device
    local = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        if ":" in device:
            raise ConfigError(
                f"device={device}: with several processes each rank takes cuda:<LOCAL_RANK>; use --device cuda or auto"
            )
        if local >= torch.cuda.device_count():
            raise ConfigError(
                f"LOCAL_RANK {local}: this machine has {torch.cuda.device_count()} GPU(s); "
                "start at most that many processes per node"
            )
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    elif device == "auto":
        device = "cpu"
    if not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        if init_method is None:
            dist.init_process_group(backend)
        else:
            rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    return device


def shutdown() -> None:
    """Leave the process group, after freeing what still refers to it.

    DistributedDataParallel wrappers kept in reference cycles (the loop state's
    training forward) hold the gloo process group, whose worker threads then
    outlive ``destroy_process_group`` and abort the process when the interpreter
    finalises ("terminate called without an active exception"); collecting them
    first lets the group shut down while Python is still alive.
    """
    global _HOST_GROUP
    if dist.is_available() and dist.is_initialized():
        import gc

        gc.collect()
        _HOST_GROUP = None  # (destroyed with the default group)
        dist.destroy_process_group()


def barrier() -> None:
    if active():
        dist.barrier()


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of ``tensor`` over ranks (a new tensor on ``tensor``'s device; the input itself when alone)."""
    if not active():
        return tensor
    buf = tensor.detach().to(_comm_device(), copy=True)
    dist.all_reduce(buf, op=dist.ReduceOp.SUM)
    return buf.to(tensor.device)


_HOST_GROUP: Any = None


def host_group() -> Any:
    """A gloo group of every rank, for small collectives on host tensors that must neither wait on the GPU nor
    queue behind DistributedDataParallel's own (the stop vote, :class:`jascl.engine.stop.StopVote`).

    Made on first use; making a group is itself collective, so every rank must first ask at the same point.
    """
    global _HOST_GROUP
    if _HOST_GROUP is None:
        _HOST_GROUP = dist.new_group(backend="gloo")
    return _HOST_GROUP


def average_gradients(params: Iterable[torch.nn.Parameter]) -> None:
    """Replace every gradient by its mean over ranks, in place (what DistributedDataParallel does for the
    model's parameters), for trainable modules a plugin keeps outside the model; nothing when alone."""
    if not active():
        return
    n = world_size()
    for p in params:
        if p.grad is not None:
            p.grad.copy_(all_reduce_sum(p.grad) / n)


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (decisions that must agree, e.g. which sessions to reuse)."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, device=_comm_device() if dist.get_backend() == "nccl" else None)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    if not active():
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


@contextlib.contextmanager
def main_first() -> Iterator[None]:
    """Rank 0 runs the block first (e.g. generating and caching data), the others after it."""
    if is_main():
        yield
        barrier()
    else:
        barrier()
        yield


def shard(indices: Sequence[int]) -> list[int]:
    """This rank's share of ``indices`` (every ``world_size``-th, from ``rank``)."""
    return list(indices)[rank() :: world_size()]


def wrap(module: torch.nn.Module, device: torch.device, find_unused_parameters: bool = False) -> torch.nn.Module:
    """``module`` under DistributedDataParallel when several processes run, else itself."""
    if not active() or not any(p.requires_grad for p in module.parameters()):
        return module
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=ids, find_unused_parameters=find_unused_parameters)


def sync_batchnorm(model: torch.nn.Module, device: torch.device) -> int:
    """Replace ``model``'s BatchNorm layers by SyncBatchNorm, in place, when several GPU processes run.

    Each rank then normalises with the statistics of the whole global batch, as a
    one-process run does (with per-rank statistics, 4 GPUs at a global batch of 8
    normalise over 2 images each). Parameter and buffer names are unchanged, so
    checkpoints are interchangeable. PyTorch's SyncBatchNorm needs GPUs: on the CPU
    (gloo) and in one process nothing changes. Returns the number of layers replaced.
    """
    from torch.nn.modules.batchnorm import _BatchNorm

    if not active() or device.type == "cpu":
        return 0
    count = sum(isinstance(m, _BatchNorm) and not isinstance(m, torch.nn.SyncBatchNorm) for m in model.modules())
    if count:
        for name, child in list(model.named_children()):  # the top module keeps its identity
            model.add_module(name, torch.nn.SyncBatchNorm.convert_sync_batchnorm(child))
    return count


#: stop signals passed on to torchrun, which passes them on to its workers (``jascl.engine.stop``)
FORWARDED_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT", "SIGHUP")


def launch(argv: Sequence[str], nproc: int) -> int:
    """Re-run ``jascl <argv>`` as ``nproc`` processes on this machine under torchrun; returns its exit code.

    torchrun runs in its own session, so a signal reaches it once, from this process: SIGTERM,
    SIGUSR1, SIGINT (Ctrl-C) and SIGHUP sent here are passed on, and torchrun sends them to every
    worker (it handles SIGTERM, SIGINT and SIGHUP itself; SIGUSR1 is added to its list), so ``kill``,
    a scheduler's warning signal or Ctrl-C stops the run cleanly at the same step on every process.
    torchrun gives the workers 30 s to do so before it kills them. A second Ctrl-C kills torchrun at once.
    A run stopped by a signal exits with 128 + its number, as with one process (torchrun itself says 1).
    """
    import signal

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "jascl",
        *argv,
    ]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(usable_cores() // nproc, 1)))
    env.setdefault("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
    interrupts = {"n": 0}
    received: dict[str, int] = {}
    with subprocess.Popen(cmd, env=env, start_new_session=os.name == "posix") as proc:

        def forward(signum: int, frame: object) -> None:
            received.setdefault("first", signum)
            if signum == getattr(signal, "SIGINT", None):
                interrupts["n"] += 1
                if interrupts["n"] > 1:
                    raise KeyboardInterrupt
            proc.send_signal(signum)

        previous = {}
        for name in FORWARDED_SIGNALS:
            number = getattr(signal, name, None)
            if number is not None:
                previous[number] = signal.signal(number, forward)
        try:
            code = proc.wait()
            # torchrun reports a stopped worker as a failure (1); the run stopped as asked, so say which signal
            return 128 + received["first"] if code != 0 and "first" in received else code
        except BaseException:  # a second Ctrl-C: do not leave torchrun behind
            proc.kill()
            raise
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)
