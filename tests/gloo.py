"""Real gloo process groups for the multi-process tests.

The tests that exercise ``torch.distributed`` start ``world`` fresh rank processes, forked
from a fork server that imported torch, ``kfac_func`` and the test module once (a plain
spawn re-imports torch in every rank: seconds each on a busy machine). Each rank joins a
gloo group through a store file in the test's temporary directory, writes its results
there and, when it fails, its traceback to an ``.error`` file that the parent turns into
the test failure.

In a test module::

    def _worker(rank: int, world: int, tmp: str) -> None:
        with gloo_group(rank, world, tmp), record_errors(Path(tmp, f"rank{rank}.error")):
            ...  # collectives; save the results under tmp

    spawn(_worker, 2, tmp_path)  # returns once every rank has exited

The test files import this module by name: pytest puts the test directory on ``sys.path``
(rootdir-relative ``prepend`` import mode, no package ``__init__``), and the fork server
and its ranks inherit that path.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["assert_no_errors", "gloo_group", "one_thread", "record_errors", "spawn"]

PRELOAD = ("torch", "kfac_func")
"""Modules the fork server imports before it forks the first rank."""


def spawn(
    worker: Callable[..., None],
    world: int,
    tmp: str | Path,
    *args: Any,
    join: bool = True,
    preload: Sequence[str] = PRELOAD,
    errors: str | None = "*.error",
) -> mp.ProcessContext:
    """Run ``worker(rank, world, str(tmp), *args)`` on ``world`` fresh processes.

    The processes fork from a fork server that imports ``preload`` and the worker's own
    module first. Only the first call in a process configures the server; later calls
    reuse it (their ranks still import anything missing when the worker is unpickled).

    Args:
        worker: a module-level function (it is pickled by name).
        world: the number of ranks.
        tmp: the directory for the store file, the results and the error files.
        *args: further arguments for every rank.
        join: wait for every rank to exit; a rank that raised makes this raise
            ``torch.multiprocessing.ProcessRaisedException`` with its traceback. With
            ``join=False`` the caller joins (and checks ``errors``) itself.
        preload: modules the fork server imports, besides the worker's module.
        errors: after a join, fail if files matching this pattern exist in ``tmp``
            (see :func:`assert_no_errors`); None to skip the check.

    Returns:
        The process context: its ``processes`` and ``join``.
    """
    mp.get_context("forkserver").set_forkserver_preload([*preload, worker.__module__])
    ctx = mp.start_processes(
        worker,
        args=(world, str(tmp), *args),
        nprocs=world,
        join=False,
        start_method="forkserver",
    )
    if join:
        while not ctx.join():
            pass
        if errors is not None:
            assert_no_errors(tmp, errors)
    return ctx


def assert_no_errors(tmp: str | Path, pattern: str = "*.error") -> None:
    """Fail with the recorded tracebacks if any file in ``tmp`` matches ``pattern``."""
    found = sorted(Path(tmp).glob(pattern))
    assert not found, "\n".join(p.read_text() for p in found)


@contextlib.contextmanager
def gloo_group(
    rank: int,
    world: int,
    tmp: str | Path,
    store: str = "store",
    timeout: timedelta | None = None,
) -> Iterator[None]:
    """The default process group of one rank, on gloo, for the body of a ``with``.

    Sets torch to one thread (the ranks share the machine's cores), joins the group
    through the file ``tmp/store`` (``timeout`` for its collectives; None is torch's
    default) and destroys the group when the body ends, whether it returned or raised.
    A body that ends its process with ``os._exit`` skips the teardown.
    """
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/{store}",
        rank=rank,
        world_size=world,
        timeout=timeout,
    )
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def record_errors(path: str | Path, reraise: bool = True) -> Iterator[None]:
    """Write the traceback of an exception in the body to ``path``.

    The exception propagates unless ``reraise`` is False (for a rank that must exit in
    its own way whatever happened).
    """
    try:
        yield
    except Exception:
        Path(path).write_text(traceback.format_exc())
        if reraise:
            raise


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run the body with one torch thread, then restore the previous count."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
