"""How many target servers a pool may have, and a pool that cannot start them all (issue 64, item 3).

The number is bounded (``MAX_SERVERS``) and checked before anything per server is allocated: by the
decoder's config, the pools and the CLI. A pool whose Nth server cannot start (no thread, no process, no
actor, no listener thread) stops every server and thread it had started, and says which one failed.
"""

from __future__ import annotations

import queue
import threading
import time

import pytest

import dsi
from dsi.errors import ConfigError, WorkerError
from dsi.models import CallableLM, synthetic_pair
from dsi.models.emulated.synthetic import SyntheticTarget
from dsi.transport import MAX_SERVERS, make_pool
from dsi.transport import processes as processes_module
from dsi.transport.remote import STOPPED, RemotePool
from dsi.transport.threads import ThreadTargetPool
from tests.transport_support import dsi_children, wait_gone

VOCAB = 16


def model():
    return CallableLM(SyntheticTarget(VOCAB, seed=5), VOCAB, name="synthetic")


def dsi_threads() -> list[str]:
    """Names of the dsi worker threads still alive (after a short grace for those just told to stop)."""
    deadline = time.monotonic() + 5.0
    while True:
        alive = [t.name for t in threading.enumerate() if t.name.startswith("dsi-") and t.is_alive()]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.01)


@pytest.mark.parametrize("servers", [MAX_SERVERS + 1, 10**12, 10**30])
def test_too_many_target_servers_is_a_config_error_naming_the_value_and_the_limit(servers):
    target, drafter = synthetic_pair(0.8, vocab_size=VOCAB, seed=1)
    began = time.perf_counter()
    shown = str(servers) if servers < 10**15 else f"{servers:.3g}"
    with pytest.raises(ConfigError, match=rf"num_target_servers={shown.replace('+', '[+]')} must be at most "
                                          rf"{MAX_SERVERS} \(dsi.transport.MAX_SERVERS"):
        dsi.DecoderConfig(num_target_servers=servers)
    with pytest.raises(ConfigError, match=f"must be at most {MAX_SERVERS}"):
        dsi.generate(target=target, drafter=drafter, prompt=[1], max_new_tokens=2, num_target_servers=servers)
    for transport in ("threads", "processes", "ray"):  # a pool built by hand: refused before its first server
        with pytest.raises(ConfigError, match=rf"num_servers={shown.replace('+', '[+]')} must be at most"):
            make_pool(transport, target, servers, lambda event: None)
    assert time.perf_counter() - began < 60  # refused, not allocated (generous: a shared 2-core machine)
    assert not dsi_threads()


def test_the_limit_itself_is_accepted():
    assert dsi.DecoderConfig(num_target_servers=MAX_SERVERS).num_target_servers == MAX_SERVERS


def fail_thread_start(monkeypatch, failing: int) -> None:
    """Server thread ``failing`` of a thread pool cannot start (as when no thread is to be had)."""
    start = ThreadTargetPool._start_thread

    def start_thread(self, server):
        if server == failing:
            raise RuntimeError("can't start new thread")
        start(self, server)

    monkeypatch.setattr(ThreadTargetPool, "_start_thread", start_thread)


def test_a_thread_pool_whose_nth_server_cannot_start_stops_the_others(monkeypatch):
    fail_thread_start(monkeypatch, 3)
    with pytest.raises(WorkerError, match=r"could not start server thread 3 \(RuntimeError: can't start new "
                                          r"thread\); it stopped every server it had started") as info:
        make_pool("threads", model(), 6, lambda event: None)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert not dsi_threads()


def test_a_decoder_whose_pool_cannot_start_leaves_no_thread(monkeypatch):
    fail_thread_start(monkeypatch, 1)
    target, drafter = synthetic_pair(0.8, vocab_size=VOCAB, seed=1)
    with pytest.raises(WorkerError, match="could not start server thread 1"):
        dsi.build_decoder(target=target, drafter=drafter, method="dsi", num_target_servers=3)
    assert not dsi_threads()


class FakeHandle:
    """A server that is ready at once and answers nothing until it is stopped."""

    def __init__(self) -> None:
        self.answers: queue.SimpleQueue = queue.SimpleQueue()
        self.stopped = False

    def wait_ready(self, timeout: float) -> None:
        pass

    def send(self, task) -> None:
        pass

    def receive(self):
        return self.answers.get()

    def cancel(self, task_id: int) -> None:
        pass

    def request_stop(self) -> None:
        self.answers.put(STOPPED)

    def stop(self, timeout: float) -> None:
        self.stopped = True
        self.answers.put(STOPPED)

    def kill(self) -> None:
        self.stop(0.0)


@pytest.mark.parametrize("failing", ["launch", "listener"])
def test_a_remote_pool_whose_nth_server_or_listener_cannot_start_stops_what_it_started(monkeypatch, failing):
    """The process and Ray pools' shared start: a server that cannot be launched (a process or actor that cannot
    be made), or a listener thread that cannot start, stops every server launched and every listener started."""
    handles: list[FakeHandle] = []

    def launch(server: int) -> FakeHandle:
        if failing == "launch" and server == 2:
            raise OSError("[Errno 11] Resource temporarily unavailable")
        handles.append(FakeHandle())
        return handles[-1]

    if failing == "listener":
        start_listener = RemotePool._start_listener

        def listener(self, server, handle):
            if server == 2:
                raise RuntimeError("can't start new thread")
            start_listener(self, server, handle)

        monkeypatch.setattr(RemotePool, "_start_listener", listener)
    what = "process server 2" if failing == "launch" else "the listener thread of process server 2"
    with pytest.raises(WorkerError, match=f"the target pool of 4 servers could not start {what}"):
        RemotePool(launch, 4, lambda event: None, name="process")
    assert len(handles) == (2 if failing == "launch" else 4)
    assert all(h.stopped for h in handles)
    assert not dsi_threads()


def test_a_process_pool_whose_nth_process_cannot_start_leaves_no_process(monkeypatch):
    made: list = []
    server_class = processes_module.ProcessServer

    def process_server(ctx, recipe, server_id, threads, vocab_size):
        if server_id == 1:
            raise OSError("[Errno 11] Resource temporarily unavailable")
        made.append(server_class(ctx, recipe, server_id, threads, vocab_size))
        return made[-1]

    monkeypatch.setattr(processes_module, "ProcessServer", process_server)
    with pytest.raises(WorkerError, match=r"could not start process server 1 \(OSError: .*Resource temporarily"):
        make_pool("processes", model(), 3, lambda event: None)
    assert len(made) == 1
    assert not wait_gone([made[0].pid]), "the first server's process outlived the failed start"
    assert not wait_gone(dsi_children())
    assert not dsi_threads()


@pytest.mark.parametrize("argv, message", [
    (["generate", "--prompt", "x", "--sp", "257"], "--sp=257 must be an integer in [1, 256]"),
    (["demo", "--sp", "1", "1000000000000"], "--sp=1000000000000 must be an integer in [1, 256]"),
    (["selftest", "--sp", "300"], "--sp=300 must be an integer in [1, 256]"),
    (["plan", "--target-tpot", "30", "--drafter-tpot", "3", "--acceptance", "0.8", "--max-servers", "1000000000"],
     "--max-servers=1000000000 must be an integer in [1, 256]"),
    (["simulate", "--c", "0.1", "--a", "0.9", "-k", "5", "--sp", "100000000"], "--sp=100000000 must be an integer"),
    (["generate", "--prompt", "x", "--threads", "100000"], "--threads=100000 must be an integer in [1, 512]"),
])
def test_the_cli_refuses_too_many_servers_or_threads_while_parsing(argv, message, capsys):
    """The commands' flags that size servers or threads are bounded as the library is (the simulator's too:
    ``dsi plan --max-servers 1000000000`` ran for ever)."""
    from dsi.cli.main import build_parser

    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err
