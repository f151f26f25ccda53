"""One target server's work on one task, shared by every transport.

It brings the server's session to the task's context (reusing the longest common prefix of its
KV cache), runs one forward over the rest (a tree task: the tree's paths, :func:`~dsi.models.base.tree_rows`),
and turns the logit rows into what the orchestrator needs: argmax tokens (of the processed rows) always, and
when sampling the processed laws, which the decisions process as they read them
(:class:`~dsi.sampling.LazyLaws`: a verification reads its rows up to the first rejection, a tree's along one
path), with the log-probability rows where asked (:class:`~dsi.logprobs.LogprobsRead`; whole rows for prompt
logprobs). A sampled chain task that carries
its drafts' drafter probabilities is decided here, row by row up to the first rejection, and answered with the
target's probability of each draft and the one law a decision reads (:func:`~dsi.sampling.read_chain_laws`): a
remote server sends one vocabulary row where it sent ``n``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np

from dsi.models.base import CancelFlag, ModelSession, forward_rows, tree_rows
from dsi.logprobs import LogprobRows, LogprobsRead, logprob_rows
from dsi.sampling import ChainRead, GreedyRead, LazyLaws, greedy_tokens, process_rows
from dsi.transport.base import TaskResult, VerifyTask


def run_verify_task(
    session: ModelSession, task: VerifyTask, server_id: int, cancel: CancelFlag | None
) -> TaskResult:
    """Compute ``task`` on ``session``; raises ``TaskCancelled`` if ``cancel`` fires."""
    start = time.perf_counter()
    if task.fresh and session.tokens:  # the first task of its request here: computed as on a fresh server
        session.truncate(0)
    if task.tree is not None:
        return _run_tree_task(session, task, server_id, cancel, start)
    if task.ids_only:  # only the argmax ids leave the model (on a GPU: only they cross to the host)
        tokens = forward_rows(session, task.context, task.num_rows, cancel, greedy=True)  # [num_rows]
        return TaskResult(task.task_id, server_id, tokens, None, time.perf_counter() - start)
    if task.logprobs_mode is not None and task.logprobs_top is None:  # whole rows (prompt logprobs)
        logits = forward_rows(session, task.context, task.num_rows, cancel, top=task.row_top)  # [num_rows, V]
        tokens, probs, logprobs = read_rows(logits, task)
        return TaskResult(task.task_id, server_id, tokens, probs, time.perf_counter() - start, logprobs)
    if task.sampling.greedy:  # processed greedy: the ids of the processed rows (on a GPU: only they cross)
        read = GreedyRead(task.context, task.sampling, task.prompt_len, task.stop_ids)
    else:  # the laws processed as the decisions read them
        read = ChainRead(task.context, task.sampling, task.prompt_len, task.stop_ids, task.draft_probs)
    if task.logprobs_mode is not None:  # and the entries' rows (on a GPU: their top N and the committed tokens')
        read = LogprobsRead(read, task.logprobs_mode, task.logprobs_top)
    got = forward_rows(session, task.context, task.num_rows, cancel, top=task.row_top, read=read)
    got, logprobs = got if task.logprobs_mode is not None else (got, None)
    tokens, probs = (got, None) if task.sampling.greedy else got
    return TaskResult(task.task_id, server_id, tokens, probs, time.perf_counter() - start, logprobs)


def _run_tree_task(session: ModelSession, task: VerifyTask, server_id: int, cancel: CancelFlag | None,
                   start: float) -> TaskResult:
    """A tree task: every row of the tree in one :func:`~dsi.models.base.tree_rows` call, each row read with
    its own root-to-node path as prefix (penalties and ``min_tokens`` count the path's tokens)."""
    tree = task.tree
    if task.ids_only:
        tokens = tree_rows(session, task.context, tree, cancel, greedy=True)  # [1 + n]
        return TaskResult(task.task_id, server_id, tokens, None, time.perf_counter() - start)
    logits = tree_rows(session, task.context, tree, cancel, top=task.row_top)  # [1 + n, V]
    if task.logprobs_mode is None and not task.sampling.greedy:
        return TaskResult(task.task_id, server_id, *_lazy_tree_rows(logits, task), time.perf_counter() - start)
    tokens = np.empty(task.num_rows, dtype=np.int64)
    probs = None if task.sampling.greedy else np.empty(logits.shape)
    values = lse = None
    if task.logprobs_mode is not None:
        values, lse = np.empty(logits.shape, dtype=np.float32), np.empty(task.num_rows)
    for rows, context in _path_rows(task):
        got_tokens, got_probs, got_logprobs = read_rows(logits[rows], task, context)
        tokens[rows] = got_tokens
        if probs is not None:
            probs[rows] = got_probs
        if values is not None:
            values[rows], lse[rows] = got_logprobs.values, got_logprobs.lse
    logprobs = None if values is None else LogprobRows(values, lse)
    return TaskResult(task.task_id, server_id, tokens, probs, time.perf_counter() - start, logprobs)


def _path_rows(task: VerifyTask) -> Iterator[tuple[list[int], tuple[int, ...]]]:
    """A tree task's rows, path by path, each row once: the rows a root-to-leaf path adds and the path's context.
    The rows an earlier path read are this path's first ones (a node's path holds its ancestors), so the rest are
    the last rows of the chain of this path, read with their prefixes as a chain's."""
    tree = task.tree
    read = np.zeros(task.num_rows, dtype=bool)
    for path in tree.paths() or [[]]:
        rows = [r for r in [0] + [1 + node for node in path] if not read[r]]
        read[rows] = True
        yield rows, task.context + tuple(tree.tokens[node] for node in path)


def _lazy_tree_rows(logits: np.ndarray, task: VerifyTask) -> tuple[np.ndarray, LazyLaws]:
    """A sampled tree's rows: the argmax ids of the processed rows now, and their laws processed when the walk
    reads them (:class:`~dsi.sampling.LazyLaws`): a walk reads one path's rows of a tree's, so most of a tree's
    rows (each a float64 pass over the vocabulary) are never processed. Each row is checked here, so a broken
    row fails the task on the server as a processed one did."""
    tokens = np.empty(task.num_rows, dtype=np.int64)
    contexts: list[tuple[int, ...]] = []
    owner = [0] * task.num_rows
    lengths = [0] * task.num_rows
    for rows, context in _path_rows(task):
        tokens[rows] = greedy_tokens(logits[rows], task.sampling, context, task.prompt_len, task.stop_ids)
        for offset, row in enumerate(rows):
            owner[row], lengths[row] = len(contexts), len(context) - len(rows) + 1 + offset
        contexts.append(context)
    return tokens, LazyLaws(logits, task.sampling, contexts, owner, lengths, task.prompt_len, task.stop_ids)


def read_rows(logits: np.ndarray, task: VerifyTask, context: tuple[int, ...] | None = None,
              ) -> tuple[np.ndarray, np.ndarray | None, LogprobRows | None]:
    """What the decisions need of ``task``'s logit rows ``[num_rows, V]`` over ``context`` (default: the
    task's): the argmax ids of the processed rows, the processed laws when sampling (None when greedy:
    the ids say everything), and the log-probability rows when the task asks for them."""
    params = task.sampling
    context = task.context if context is None else context
    probs = None
    if params.greedy:
        tokens = greedy_tokens(logits, params, context, task.prompt_len, task.stop_ids)  # [num_rows]
    else:
        probs = process_rows(logits, params, context, task.prompt_len, task.stop_ids)  # [num_rows, V]
        tokens = np.argmax(probs, axis=-1).astype(np.int64)
    logprobs = None
    if task.logprobs_mode is not None:
        logprobs = logprob_rows(logits, params, context, task.prompt_len, task.stop_ids, task.logprobs_mode, probs)
    return tokens, probs, logprobs
