"""The dispatcher: cache affinity for idle servers, FIFO queue, cancellation of queued tasks."""

from __future__ import annotations

from dsi.sampling import SamplingParams
from dsi.transport.base import VerifyTask
from dsi.transport.dispatch import Dispatcher


def task(task_id, context):
    return VerifyTask(task_id, tuple(context), 1, SamplingParams())


def test_idle_server_with_longest_common_prefix_wins():
    d = Dispatcher(3)
    assert d.place(task(0, [1, 2, 3])) == 0  # all cold: lowest id
    assert d.place(task(1, [9, 9])) == 1
    d.finish(0)
    d.finish(1)
    # server 1 last saw [9, 9]; server 0 saw [1, 2, 3]; server 2 nothing
    assert d.place(task(2, [1, 2, 3, 4])) == 0
    assert d.place(task(3, [9, 9, 5])) == 1
    assert d.place(task(4, [1, 2])) == 2  # only idle server left


def test_busy_servers_queue_fifo_and_cancel_drops_queued():
    d = Dispatcher(1)
    assert d.place(task(0, [1])) == 0
    assert d.place(task(1, [1, 2])) is None
    assert d.place(task(2, [1, 2, 3])) is None
    assert d.place(task(3, [1, 2, 3, 4])) is None
    assert d.cancel([2, 0]) == [0]  # task 0 is running on server 0; task 2 leaves the queue
    assert d.finish(0).task_id == 1
    assert d.finish(0).task_id == 3
    assert d.finish(0) is None


def test_dead_server_gets_no_work():
    d = Dispatcher(2)
    d.place(task(0, [1]))
    assert d.mark_dead(0).task_id == 0
    assert d.place(task(1, [1])) == 1
    assert d.place(task(2, [1])) is None
    assert d.finish(0) is None  # dead server does not take the queued task
    assert d.finish(1).task_id == 2
