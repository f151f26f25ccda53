"""One target server's work on one task, shared by every transport.

It brings the server's session to the task's context (reusing the longest common prefix of its
KV cache), runs one forward over the rest, and turns the logit rows into what the orchestrator
needs: argmax tokens (of the processed rows) always, processed probability rows only when sampling.
"""

from __future__ import annotations

import time

import numpy as np

from dsi.models.base import CancelFlag, ModelSession, forward_rows, top_hint
from dsi.logprobs import logprob_rows
from dsi.sampling import greedy_tokens, process_rows
from dsi.transport.base import TaskResult, VerifyTask


def run_verify_task(
    session: ModelSession, task: VerifyTask, server_id: int, cancel: CancelFlag | None
) -> TaskResult:
    """Compute ``task`` on ``session``; raises ``TaskCancelled`` if ``cancel`` fires."""
    start = time.perf_counter()
    params, logprobs, probs = task.sampling, None, None
    if params.raw_argmax and task.logprobs_mode is None:  # only the argmax ids leave the model (on a GPU:
        tokens = forward_rows(session, task.context, task.num_rows, cancel, greedy=True)  # only they cross to the host)
    else:
        top = None if task.logprobs_mode is not None else top_hint(params)
        logits = forward_rows(session, task.context, task.num_rows, cancel, top=top)  # [num_rows, V]
        if params.greedy:  # the argmax ids of the processed rows say everything
            tokens = greedy_tokens(logits, params, task.context, task.prompt_len, task.stop_ids)  # [num_rows]
        else:
            probs = process_rows(logits, params, task.context, task.prompt_len, task.stop_ids)  # [num_rows, V]
            tokens = np.argmax(probs, axis=-1).astype(np.int64)
        if task.logprobs_mode is not None:
            logprobs = logprob_rows(logits, params, task.context, task.prompt_len, task.stop_ids, task.logprobs_mode,
                                    probs)
    return TaskResult(task.task_id, server_id, tokens, probs, time.perf_counter() - start, logprobs)
