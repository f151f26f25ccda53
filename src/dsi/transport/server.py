"""One target server's work on one task, shared by every transport.

It brings the server's session to the task's context (reusing the longest common prefix of its
KV cache), runs one forward over the rest, and turns the logit rows into what the orchestrator
needs: argmax tokens always, processed probability rows only when sampling.
"""

from __future__ import annotations

import time

import numpy as np

from dsi.models.base import CancelFlag, ModelSession, forward_rows, top_hint
from dsi.sampling import process_logits
from dsi.transport.base import TaskResult, VerifyTask


def run_verify_task(
    session: ModelSession, task: VerifyTask, server_id: int, cancel: CancelFlag | None
) -> TaskResult:
    """Compute ``task`` on ``session``; raises ``TaskCancelled`` if ``cancel`` fires."""
    start = time.perf_counter()
    if task.sampling.greedy:  # only the argmax ids leave the model (on a GPU: only they cross to the host)
        tokens = forward_rows(session, task.context, task.num_rows, cancel, greedy=True)  # [num_rows]
        probs = None
    else:
        logits = forward_rows(session, task.context, task.num_rows, cancel, top=top_hint(task.sampling))  # [num_rows, V]
        probs = np.stack([process_logits(row, task.sampling) for row in logits])  # [num_rows, V]
        tokens = np.argmax(probs, axis=-1).astype(np.int64)
    return TaskResult(task.task_id, server_id, tokens, probs, time.perf_counter() - start)
