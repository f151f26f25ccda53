"""One target server's work on one task, shared by every transport.

It brings the server's session to the task's context (reusing the longest common prefix of its
KV cache), runs one forward over the rest, and turns the logit rows into what the orchestrator
needs: argmax tokens (of the processed rows) always, processed probability rows only when sampling.
"""

from __future__ import annotations

import time

import numpy as np

from dsi.models.base import CancelFlag, ModelSession, forward_rows
from dsi.logprobs import LogprobRows, logprob_rows
from dsi.sampling import greedy_tokens, process_rows
from dsi.transport.base import TaskResult, VerifyTask


def run_verify_task(
    session: ModelSession, task: VerifyTask, server_id: int, cancel: CancelFlag | None
) -> TaskResult:
    """Compute ``task`` on ``session``; raises ``TaskCancelled`` if ``cancel`` fires."""
    start = time.perf_counter()
    if task.ids_only:  # only the argmax ids leave the model (on a GPU: only they cross to the host)
        tokens = forward_rows(session, task.context, task.num_rows, cancel, greedy=True)  # [num_rows]
        return TaskResult(task.task_id, server_id, tokens, None, time.perf_counter() - start)
    logits = forward_rows(session, task.context, task.num_rows, cancel, top=task.row_top)  # [num_rows, V]
    tokens, probs, logprobs = read_rows(logits, task)
    return TaskResult(task.task_id, server_id, tokens, probs, time.perf_counter() - start, logprobs)


def read_rows(logits: np.ndarray, task: VerifyTask) -> tuple[np.ndarray, np.ndarray | None, LogprobRows | None]:
    """What the decisions need of ``task``'s logit rows ``[num_rows, V]``: the argmax ids of the processed
    rows, the processed laws when sampling (None when greedy: the ids say everything), and the
    log-probability rows when the task asks for them."""
    params = task.sampling
    probs = None
    if params.greedy:
        tokens = greedy_tokens(logits, params, task.context, task.prompt_len, task.stop_ids)  # [num_rows]
    else:
        probs = process_rows(logits, params, task.context, task.prompt_len, task.stop_ids)  # [num_rows, V]
        tokens = np.argmax(probs, axis=-1).astype(np.int64)
    logprobs = None
    if task.logprobs_mode is not None:
        logprobs = logprob_rows(logits, params, task.context, task.prompt_len, task.stop_ids, task.logprobs_mode, probs)
    return tokens, probs, logprobs
