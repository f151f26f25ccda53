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


def scoped(task_id, context, request):
    return VerifyTask(task_id, tuple(context), 1, SamplingParams(), request=request)


def test_a_request_s_first_task_on_a_server_is_fresh_and_later_ones_reuse_its_cache():
    """A task of request r on a server whose cache request q != r filled is marked fresh (the server empties its
    cache first), counts its whole context as work, and is placed as if that cache were empty; the tasks after
    it on that server reuse what r cached there."""
    d = Dispatcher(2)
    assert d.place(scoped(0, [1, 2, 3], request=1)) == 0
    assert d.running[0].fresh  # nothing cached yet is request 1's
    assert d.new_tokens[0] == 3
    d.finish(0)
    assert d.place(scoped(1, [1, 2, 3, 4], request=1)) == 0  # the same request: its own cache wins
    assert not d.running[0].fresh and d.new_tokens[0] == 1
    d.finish(0)
    assert d.place(scoped(2, [1, 2, 3, 4, 5], request=2)) == 0  # another request: no server has anything for it
    assert d.running[0].fresh and d.new_tokens[0] == 5
    assert d.place(scoped(3, [1, 2, 3, 4, 5, 6], request=2)) == 1
    assert d.running[1].fresh


def test_tasks_without_a_request_reuse_any_cache_and_a_replaced_server_forgets_its_request():
    d = Dispatcher(1)
    d.place(scoped(0, [1, 2, 3], request=1))
    d.finish(0)
    d.place(task(1, [1, 2, 3, 4]))  # no scope (the deterministic mode): whatever the server cached is reused
    assert not d.running[0].fresh and d.new_tokens[0] == 1
    d.finish(0)
    d.place(scoped(2, [1, 2], request=1))
    assert d.running[0].fresh  # request 1 no longer owns the cache: a scope-less task filled it last
    d.finish(0)
    d.forget(0)
    d.place(scoped(3, [1, 2, 5], request=1))
    assert d.running[0].fresh and d.new_tokens[0] == 3


def test_a_fresh_task_empties_the_server_s_session_before_it_runs():
    from dsi.models import CallableLM
    from dsi.transport.server import run_verify_task

    model = CallableLM(lambda ctx: [float(len(ctx) == i) for i in range(8)], 8)
    session = model.new_session()
    session.extend([1, 2, 3, 4])
    seen = []
    extend = session.extend
    session.extend = lambda tokens, cancel=None: (seen.append(tuple(tokens)), extend(tokens, cancel))[1]
    run_verify_task(session, VerifyTask(0, (1, 2, 3, 5), 1, SamplingParams(), request=1, fresh=True), 0, None)
    assert seen == [(1, 2, 3, 5)] and session.tokens == (1, 2, 3, 5)  # the whole context, not the last token
