"""The engine core's tie to its worker (server.engines.vllm.private_api.tying) without vLLM: on a
stand-in for vLLM's ``EngineCoreProc``. With ``run_engine_core`` a static method, a
process started with it as target gets SIGKILL as its parent-death signal, and the class
is restored after; a class without it (a vLLM that moved or renamed it) is left alone, with
one line on stderr, and what is inside still runs (the engine still starts). The real core
process is tested in test_vllm_core_process.py."""

from __future__ import annotations

import ctypes
import gc
import multiprocessing
import signal

import pytest

from server.engines.vllm.private_api import _shut_down_for_exit, tying, without_collections

_PR_GET_PDEATHSIG = 2


def _death_signal() -> int:
    value = ctypes.c_int(-1)
    assert ctypes.CDLL(None).prctl(_PR_GET_PDEATHSIG, ctypes.byref(value)) == 0
    return value.value


class _Core:
    """Stand-in for vLLM's ``EngineCoreProc``: its target reports its parent-death signal."""

    @staticmethod
    def run_engine_core(conn) -> None:
        conn.send(_death_signal())
        conn.close()


class _Moved:
    """Stand-in for an ``EngineCoreProc`` whose entry point is named otherwise."""

    @staticmethod
    def run_core(conn) -> None:
        conn.send(_death_signal())


def _run_in_child(target) -> int:
    """What ``target`` reports from a forked process (as vLLM starts its core on CPU)."""
    ctx = multiprocessing.get_context("fork")
    ours, theirs = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(theirs,))
    proc.start()
    theirs.close()
    try:
        return ours.recv()
    finally:
        proc.join()
        ours.close()


def test_the_core_process_gets_sigkill_when_its_parent_dies():
    original = _Core.__dict__["run_engine_core"]
    with tying(_Core):
        assert _run_in_child(_Core.run_engine_core) == signal.SIGKILL
    assert _Core.__dict__["run_engine_core"] is original
    assert _run_in_child(_Core.run_engine_core) == 0  # (untied outside)


def test_a_vllm_without_run_engine_core_starts_untied_with_one_line(capsys):
    before = dict(_Moved.__dict__)
    ran = False
    with tying(_Moved):
        ran = True
        assert "run_engine_core" not in _Moved.__dict__
        assert _run_in_child(_Moved.run_core) == 0
    assert ran and dict(_Moved.__dict__) == before
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert "_Moved.run_engine_core" in err[0] and "not tied" in err[0]


def test_a_vllm_without_the_core_class_starts_untied_with_one_line(capsys):
    with tying(None):
        pass
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "vllm.v1.engine.core.EngineCoreProc.run_engine_core" in err[0], err


class _Derived(_Core):
    """Stand-in for an ``EngineCoreProc`` that inherits its entry point."""


def test_an_inherited_run_engine_core_is_tied_and_the_class_restored_as_it_was():
    base = dict(_Core.__dict__)
    with tying(_Derived):
        assert "run_engine_core" in _Derived.__dict__ and dict(_Core.__dict__) == base
        assert _run_in_child(_Derived.run_engine_core) == signal.SIGKILL
        assert _run_in_child(_Core.run_engine_core) == 0  # (the base class is not tied)
    assert "run_engine_core" not in _Derived.__dict__  # inherited again, not copied
    assert _Derived.run_engine_core is _Core.run_engine_core
    assert _run_in_child(_Derived.run_engine_core) == 0


def test_nested_ties_keep_the_tie_until_the_last_ends_and_restore_the_original():
    original = _Core.__dict__["run_engine_core"]
    with tying(_Core):
        with tying(_Core):
            assert _run_in_child(_Core.run_engine_core) == signal.SIGKILL
        assert _run_in_child(_Core.run_engine_core) == signal.SIGKILL  # (still tied)
    assert _Core.__dict__["run_engine_core"] is original
    assert _run_in_child(_Core.run_engine_core) == 0


def test_ties_that_end_out_of_order_restore_the_original():
    """Two ties that overlap without nesting (one begun first ends first, as from two
    threads): the class stays tied while either is open, then is restored exactly."""
    original = _Core.__dict__["run_engine_core"]
    first, second = tying(_Core), tying(_Core)
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert _run_in_child(_Core.run_engine_core) == signal.SIGKILL
    second.__exit__(None, None, None)
    assert _Core.__dict__["run_engine_core"] is original
    assert _run_in_child(_Core.run_engine_core) == 0


def test_without_collections_skips_collections_inside_and_restores_them_after_an_error():
    collect, unfreeze = gc.collect, gc.unfreeze
    with pytest.raises(RuntimeError), without_collections():
        assert gc.collect() == 0 and gc.unfreeze() is None
        assert gc.collect is not collect and gc.unfreeze is not unfreeze
        raise RuntimeError
    assert gc.collect is collect and gc.unfreeze is unfreeze


def test_the_core_process_shuts_down_without_collections_passing_what_it_is_given():
    """(in the core's process: a stand-in for vLLM's class, whose shutdown collects)"""
    seen: list = []

    class Core:
        def shutdown(self, *args, **kwargs):
            seen.append((args, kwargs, gc.collect is _real_collect))

    _real_collect = gc.collect
    _shut_down_for_exit(Core)
    Core().shutdown(1, timeout=2)
    assert seen == [((1,), {"timeout": 2}, False)]
    assert gc.collect is _real_collect
