"""A preemption signal is not lost when its exception is: the launcher's handler raises `Stopped`
and records it (launch/stopping.py), because Python drops an exception raised while it runs a
finalizer ("Exception ignored in ..."), or catches and logs it (asyncio, when the signal lands in a
protocol callback of an HTTP read). A real warm start (tiny model, demo data) whose stop is
raised into a finalizer -- as the suite saw a SIGTERM land in `regex`'s `Group.__del__` and the
warm start train on for minutes -- stops at its next step and writes no model folder; and the
launcher does not print the dropped stop as an error (`quiet_when_dropped`), from a finalizer or
from asyncio over a real loopback connection, while any other exception is still reported."""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import signal

import pytest

from megatron_darl.config import load_config
from megatron_darl.launch import stopping, warmstart
from megatron_darl.launch.session import Stopped

DEMO = os.path.join(os.path.dirname(__file__), "..", "..", "..", "configs", "cpu_demo_darl.yaml")


class _Finalizer:
    """An object whose finalizer raises what the handler raises when the signal lands in it."""

    def __del__(self):
        raise stopping.record(Stopped(signal.SIGTERM))


def test_a_pending_stop_is_raised_once_and_clear_forgets_it():
    stopping.raise_pending()  # nothing pending: nothing happens
    _Finalizer()  # its exception is dropped ("Exception ignored in ..."), the stop stays pending
    with pytest.raises(Stopped, match="SIGTERM before training started"):
        stopping.raise_pending()
    stopping.raise_pending()  # once
    stopping.record(Stopped(signal.SIGTERM))
    stopping.clear()
    stopping.raise_pending()


def test_a_dropped_stop_is_not_printed_as_an_error_and_anything_else_is(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr("sys.unraisablehook", lambda u: seen.append(u.exc_value))  # as Python's, recording
    stopping.quiet_when_dropped()
    try:
        _Finalizer()
        assert seen == []  # the launcher's output shows no "Exception ignored in ..." for it
        with pytest.raises(Stopped):
            stopping.raise_pending()

        class Broken:
            def __del__(self):
                raise ValueError("a real error in a finalizer")

        Broken()
        assert [type(e) for e in seen] == [ValueError]  # still reported
    finally:
        stopping.clear()


def _raise_in_data_received(exc: BaseException) -> BaseException | None:
    """A loopback TCP server writes one chunk; the client protocol's `data_received` raises `exc`
    (as the handler raises when the signal lands there). Returns what `connection_lost` got."""

    async def main():
        lost = asyncio.get_running_loop().create_future()

        class Client(asyncio.Protocol):
            def data_received(self, data):
                raise exc

            def connection_lost(self, why):
                lost.set_result(why)

        async def serve(reader, writer):
            writer.write(b"HTTP/1.1 200 OK\r\n")
            await writer.drain()
            await reader.read()  # until the client is gone
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            await asyncio.get_running_loop().create_connection(Client, "127.0.0.1", port)
            return await asyncio.wait_for(lost, 10)

    return asyncio.run(main())


def test_a_stop_asyncio_catches_in_a_protocol_is_not_logged_and_anything_else_is(tmp_path):
    logged: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = logged.append
    log = logging.getLogger("asyncio")
    log.addHandler(handler)
    stopping.quiet_when_dropped()
    try:
        stop = stopping.record(Stopped(signal.SIGTERM, "during the evaluation after training"))
        assert _raise_in_data_received(stop) is stop  # the stop reaches the connection's user
        assert logged == []  # no "Fatal error: protocol.data_received() call failed." for it
        with pytest.raises(Stopped):
            stopping.raise_pending()
        other = ValueError("a real error in a protocol")
        assert _raise_in_data_received(other) is other
        assert [r.exc_info[1] for r in logged] == [other]  # still reported
    finally:
        log.removeHandler(handler)
        stopping.clear()


def test_a_stop_lost_in_a_finalizer_ends_the_warm_start_at_its_next_step(tmp_path, monkeypatch):
    cfg = load_config(DEMO, [f"train.run_dir={tmp_path}", "demo.sft_steps=200", "demo.sft_target=0"])
    real, steps = warmstart.answer_batch, []

    def batch(tok, prompts, plan=None):
        steps.append(len(prompts))
        if len(steps) == 3:
            _Finalizer()  # the stop is raised into a finalizer during the third step and lost there
        return real(tok, prompts, plan)

    monkeypatch.setattr(warmstart, "answer_batch", batch)
    try:
        with pytest.raises(Stopped):
            warmstart.prepare_model(cfg)
    finally:
        stopping.clear()
    assert len(steps) == 3, f"the warm start went on for {len(steps) - 3} steps after the stop"
    assert not glob.glob(os.path.join(str(tmp_path), "model*")), "a stopped warm start wrote a model folder"
