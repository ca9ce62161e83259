"""The tensor-parallel process group: start the ranks, carry each step to them, watch them, stop them.

Rank 0 runs the engine. Without ``torchrun`` it starts ranks 1..N-1 itself (``spawn``), with
a rendezvous store on a loopback port it binds first (so the port is free and nothing listens
beyond 127.0.0.1); under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) every process already
exists, rank 0 returns to the engine and the others run the worker loop, then exit.

Two process groups: the default one carries one broadcast per step from rank 0
(:class:`~pagedkv.core.dist.step_channel.StepChannel`; rank 0 does not wait for it) and lets the other
ranks wait as long as the engine idles; ``model_group`` carries the layers' all-reduces with a
short timeout (``PAGEDKV_TP_TIMEOUT`` seconds, default 60), so a hung rank ends the step with an
error in bounded time. A rank that dies closes its sockets, which fails the next collective at once;
rank 0 also checks its children before every step.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from pagedkv.core.errors import ConfigError, PagedKVError
from pagedkv.core.dist.step_channel import StepChannel

TIMEOUT_ENV = "PAGEDKV_TP_TIMEOUT"
DEFAULT_TIMEOUT_S = 60.0
IDLE_TIMEOUT = datetime.timedelta(days=7)  # workers wait this long for the next step of an idle engine
STOP_GRACE_S = 5.0
START_TIMEOUT_S = 600.0  # loading a large model on every rank may take minutes


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """No progress bars while saving or loading the weights the ranks share."""
    from transformers.utils import logging

    was_on = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            logging.enable_progress_bar()


class TensorParallelError(PagedKVError, RuntimeError):
    """A tensor-parallel rank died, hung or failed; the engine cannot go on."""


def collective_timeout() -> datetime.timedelta:
    try:
        seconds = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    except ValueError:
        raise ConfigError(f"{TIMEOUT_ENV} must be a number of seconds") from None
    return datetime.timedelta(seconds=seconds)


def torchrun_rank(world_size: int) -> int | None:
    """This process's rank when launched by torchrun (or any ``torch.distributed.run`` launcher), else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    launched = int(os.environ["WORLD_SIZE"])
    if launched != world_size:
        raise ConfigError(
            f"the launcher started {launched} processes but tensor_parallel_size is {world_size}; make them equal"
        )
    return int(os.environ["RANK"])


def rank_device(config_device: str, local_rank: int) -> str:
    """Rank ``r`` of a node uses ``cuda:r`` (its own GPU); on CPU every rank uses the CPU."""
    return f"cuda:{local_rank}" if config_device.startswith("cuda") else "cpu"


class TensorParallelGroup:
    """This process's view of the ranks: its rank, the two groups, and (on rank 0) the children it started."""

    def __init__(self, rank: int, world_size: int, device: str, processes: list[Any], scratch: str | None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.processes = processes
        self.scratch = scratch  # a temp dir holding an in-memory model's weights for the children
        self.timeout = collective_timeout()
        self.model_group: Any = dist.new_group(list(range(world_size)), timeout=self.timeout)
        self.comm_seconds = 0.0  # time in collectives on this rank (steps' broadcasts and all-reduces)
        self.closed = False
        self.channel = StepChannel(torch.device(device) if device.startswith("cuda") else torch.device("cpu"))
        if rank == 0:
            atexit.register(self.close)

    # --- starting ------------------------------------------------------------------------------------

    @classmethod
    def launch(cls, config: Any, model: Any, from_config: bool, worker_main: Any) -> TensorParallelGroup:
        """Join (under torchrun) or create the ranks; ``worker_main`` is the entry point of a spawned rank.
        On rank 0 ``model`` is cut to its shard; another rank's caller serves steps with its group."""
        from pagedkv.core.dist.tensor_parallel import check_divisible, decoder_layers

        world_size = config.tensor_parallel_size
        if dist.is_initialized():
            raise ConfigError("a process group is already initialized here (one tensor-parallel engine per process "
                              "at a time): close the other engine first")
        check_divisible(model.config, world_size)  # before any process starts
        decoder_layers(model)
        backend = "nccl" if config.device.startswith("cuda") else "gloo"
        if backend == "nccl":
            os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")  # a timed-out collective raises
        rank = torchrun_rank(world_size)
        if rank is not None:
            local_rank = int(os.environ.get("LOCAL_RANK", rank))
            device = rank_device(config.device, local_rank)
            if device.startswith("cuda"):
                torch.cuda.set_device(device)
            dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=IDLE_TIMEOUT)
            group = cls(rank, world_size, device, [], None)
            if rank != 0:
                return group
        else:
            group = cls._spawn(config, model, from_config, backend, world_size, worker_main)
        group.shard(model)
        return group

    @classmethod
    def _spawn(cls, config: Any, model: Any, from_config: bool, backend: str, world_size: int,
               worker_main: Any) -> TensorParallelGroup:
        scratch = None
        if from_config:
            from pagedkv.core.model.model_loader import resolve_model_dir

            source = str(resolve_model_dir(config.model))
        else:  # a model built in memory: the children load the same weights from a temp dir
            scratch = source = tempfile.mkdtemp(prefix="pagedkv-tp-")
            with quiet_transformers():
                model.save_pretrained(scratch)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", int(os.environ.get("MASTER_PORT") or 0)))  # MASTER_PORT, or a free one
        listener.listen()
        port = listener.getsockname()[1]
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's own sockets on loopback too (children inherit)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        ctx = torch.multiprocessing.get_context("spawn")
        threads = max(1, torch.get_num_threads() // world_size)
        processes = []
        try:
            for rank in range(1, world_size):
                proc = ctx.Process(
                    target=worker_main, args=(rank, world_size, port, config, source, threads),
                    name=f"pagedkv-tp-rank{rank}", daemon=True,
                )
                proc.start()
                processes.append(proc)
            store = dist.TCPStore(
                "127.0.0.1", port, world_size, is_master=True, timeout=collective_timeout(),
                master_listen_fd=listener.fileno(),
            )
            dist.init_process_group(backend, store=store, rank=0, world_size=world_size, timeout=IDLE_TIMEOUT)
        except BaseException as exc:
            _stop(processes)
            shutil.rmtree(scratch or "", ignore_errors=True)
            raise TensorParallelError(f"could not start {world_size - 1} tensor-parallel worker(s): {exc}") from exc
        finally:
            listener.close()
        device = rank_device(config.device, 0)
        return cls(0, world_size, device, processes, scratch)

    def shard(self, model: Any) -> None:
        from pagedkv.core.dist.tensor_parallel import shard_model

        shard_model(model, self.rank, self.world_size, self.all_reduce)

    # --- the collectives -------------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor) -> None:
        started = time.perf_counter()
        dist.all_reduce(tensor, group=self.model_group)
        self.comm_seconds += time.perf_counter() - started

    def broadcast(self, message: Any) -> Any:
        """Rank 0 sends ``message`` to every rank (one broadcast, not awaited); the others wait for it and get it."""
        started = time.perf_counter()
        if self.rank == 0:
            self.channel.send(message)
        else:
            message = self.channel.receive()
        self.comm_seconds += time.perf_counter() - started
        return message

    def wait_ready(self) -> None:
        """Rank 0: wait until every rank has loaded its shard, watching the children instead of timing out early."""
        work = dist.barrier(async_op=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not work.is_completed():
            self.check_workers()
            if time.monotonic() > deadline:
                self.fail(TimeoutError(f"the ranks were not ready after {START_TIMEOUT_S:.0f} s"))
            time.sleep(0.02)
        work.wait()

    def ready(self) -> None:
        """Every other rank: tell rank 0 this rank is ready."""
        dist.barrier()

    # --- faults and shutdown ---------------------------------------------------------------------------

    def check_workers(self) -> None:
        """Raise (after stopping every rank) if a child this rank started has exited."""
        dead = [p for p in self.processes if not p.is_alive()]
        if dead:
            self.fail(None)

    def fail(self, cause: BaseException | None) -> None:
        """Stop every rank and raise a :class:`TensorParallelError` that says which rank failed and how."""
        deadline = time.monotonic() + (1.0 if cause is not None else 0.0)
        while time.monotonic() < deadline and all(p.is_alive() for p in self.processes):
            time.sleep(0.02)  # a collective failed: let a dying child's exit code land
        dead = [f"rank {i + 1} (pid {p.pid}) exited with code {p.exitcode}"
                for i, p in enumerate(self.processes) if not p.is_alive()]
        what = "; ".join(dead) or f"{type(cause).__name__}: {(str(cause).splitlines() or [''])[0]}"
        self.close(notify=False)
        raise TensorParallelError(
            f"tensor-parallel worker failure, the engine stopped: {what}"
            + ("" if dead else f" (a rank hung or failed; collective timeout "
                                f"{TIMEOUT_ENV}={self.timeout.total_seconds():g} s)")
        ) from cause

    def close(self, notify: bool = True) -> None:
        """Stop the workers (a stop message, then SIGTERM, then SIGKILL) and leave the process group."""
        if self.closed:
            return
        self.closed = True
        if notify and self.rank == 0 and all(p.is_alive() for p in self.processes):
            try:
                self.broadcast(None)
            except Exception:  # noqa: BLE001 - a broken group: the children are stopped below anyway
                pass
        _stop(self.processes, STOP_GRACE_S if notify else 0.0)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group has nothing left to destroy
                pass
        if self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)
        atexit.unregister(self.close)


def _stop(processes: list[Any], grace_s: float = STOP_GRACE_S) -> None:
    """Wait ``grace_s`` for the processes to exit, then SIGTERM, then SIGKILL."""
    deadline = time.monotonic() + grace_s
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
            proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join()
