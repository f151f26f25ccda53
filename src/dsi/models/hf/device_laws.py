"""A verification's decisions on the model's device: rows read where they are.

A sampled chain task that carries its drafts' drafter probabilities (:class:`~dsi.sampling.ChainRead`) needs of
its ``n`` rows only the target's probability of each draft, up to the first rejection, and one whole law (the
rejected row's, for its residual, or the last row's); a greedy one whose processors can move the argmax
(:class:`~dsi.sampling.GreedyRead`) needs only each processed row's argmax; non-SI's draw
(:class:`~dsi.sampling.BonusRead`) only its token. On a GPU the rows are on the device:
this module processes them there and moves to the host only those numbers, where the host path moved ``n`` rows of
152k floats and processed each one it read in numpy.

- The processors before temperature (:func:`shape_rows`): the few ids they touch in each row are gathered, processed
  on the host by the host's own code (:func:`dsi.sampling.process_touched`) and written back, and a constraint's
  masks set the rest to -inf: the shaped rows are the host's bit for bit, and so are greedy's argmax ids.
- A drafter's draw (:func:`draft`): its law made and drawn from on the device; the token and its probability
  cross, and the law stays there (:class:`DeviceLaw`) until a rejection's residual reads it whole.
- Log-probabilities (:func:`with_logprobs`): each row's top N and the log-probabilities of the tokens its decision
  can commit; a whole row only where the engine draws the token from a law it reads.
- Sampled laws (:func:`distribution`): temperature, min_p, top-k and top-p in a few batched kernels, as
  :func:`dsi.sampling._distribution` does (float32, the same float64 comparisons). The accept test itself stays
  :func:`dsi.sampling.accepts` on the host (a counter-based uniform against ``p / q``): the engine's own test on the
  same numbers. The laws are the processed softmax within float32 rounding, as the host's are, but not bit for bit
  the host's (another ``exp`` and summation order): a request whose rows are all decided on one device gives the
  same tokens for one seed whatever the SP and timing; a mix of the two paths may differ where a uniform falls
  within rounding of a boundary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from dsi.errors import ModelError
from dsi.logprobs import LogprobsRead, ReadLogprobs, TopLogprobs
from dsi.sampling import (
    _SCALED_T,
    LAW_DTYPE,
    BonusRead,
    ChainRead,
    DraftRead,
    GreedyRead,
    LastRowRead,
    Prefix,
    Purpose,
    ReadLaws,
    RowsRead,
    SamplingParams,
    chain_counts,
    decide_chain,
    drafting,
    process_touched,
    shape_logits,
    touched_ids,
    uniform,
)


def check_rows(rows: torch.Tensor) -> None:
    """:class:`ModelError` for a row with a NaN logit, or with -inf only (:func:`dsi.sampling.check_logit_row`),
    read at once (one transfer). The decisions that need no host round trip on the way check their rows with the
    numbers they move anyway (:func:`_usable`, :func:`_refuse_unusable`)."""
    _refuse_unusable(_usable(rows.max(dim=-1).values).cpu().numpy(), rows.shape[0])


def _usable(top: torch.Tensor) -> torch.Tensor:
    """``[n]`` float64 on the device, 1 where a row whose maximum is ``top`` can make a law (neither NaN nor -inf:
    a NaN logit is the maximum of its row, as torch reduces NaN), else 0: read with the decisions' numbers."""
    return (top > -math.inf).to(torch.float64)


def _refuse_unusable(usable: np.ndarray, n: int) -> None:
    """The :class:`ModelError` of :func:`check_rows` where ``usable`` (:func:`_usable`, read) has a 0."""
    if not usable.all():
        which = np.flatnonzero(usable == 0).tolist()
        raise ModelError(f"the target returned NaN or all -inf logits in rows {which} of {n}: no distribution "
                         "can be made of them")


def shape_rows(rows: torch.Tensor, params: SamplingParams, tokens: Sequence[int], prompt_len: int,
               stop_ids: frozenset[int]) -> torch.Tensor:
    """:func:`dsi.sampling.shape_rows` on the device: the last ``n`` rows of a forward over ``tokens`` after the
    processors before temperature, float64 ``[n, V]``, bit for bit the host's. The ids the processors touch are
    gathered to the host (a few numbers a row), processed there by the host's own code
    (:func:`~dsi.sampling.process_touched`) and written back; a constraint's masks (made on the host from the
    output) set the rest to -inf. Checked: a row left without a possible token raises as on the host."""
    n, vocab = rows.shape
    x = rows.to(torch.float64, copy=True)  # [n, V]; the model's output buffer (a graph's) stays as it is
    touched, allowed = [], []  # per row: the ids the processors touch, and a constraint's mask
    for counts in chain_counts(params, tokens, prompt_len, n, vocab):
        touched.append(touched_ids(params, counts, stop_ids, vocab))
        if params.constraint is not None:
            allowed.append(constraint_mask(params, counts, vocab))
    flat = [j * vocab + ids for j, ids in enumerate(touched) if ids.size]
    if flat:
        where = torch.from_numpy(np.concatenate(flat)).to(x.device)
        raw = x.view(-1)[where].cpu().numpy()  # the touched ids' raw values, one transfer
        done = 0
        for ids, counts in zip(touched, chain_counts(params, tokens, prompt_len, n, vocab)):
            if ids.size:
                raw[done:done + ids.size] = process_touched(raw[done:done + ids.size], ids, vocab, params, counts,
                                                            stop_ids)
                done += ids.size
        x.view(-1)[where] = torch.from_numpy(raw).to(x.device)
    if allowed:
        x.masked_fill_(~torch.from_numpy(np.stack(allowed)).to(x.device), -math.inf)
    empty = x.max(dim=-1).values == -math.inf
    if bool(empty.any()):  # the host's own error for that row (a constraint's, or min_tokens')
        j = int(torch.nonzero(empty).flatten()[0])
        prefix = Prefix(tuple(tokens[: len(tokens) - n + 1 + j]), prompt_len, stop_ids)
        shape_logits(rows[j].float().cpu().numpy(), params, prefix if params.uses_prefix else None)
        raise ModelError(f"row {j} of {n}: no token is possible after the processors")
    return x


def constraint_mask(params: SamplingParams, counts, vocab: int) -> np.ndarray:
    """``[V]`` bool: the ids a request's constraint allows after the output ``counts`` holds (all of them where
    the row's output ran past an EOS or a refused draft: :mod:`dsi.constraints`)."""
    allowed = params.constraint.allowed(counts.tail)
    if allowed.size >= vocab:
        return allowed[:vocab]
    return np.concatenate([allowed, np.zeros(vocab - allowed.size, dtype=bool)])


def greedy_ids(rows: torch.Tensor, read: GreedyRead) -> np.ndarray:
    """:class:`~dsi.sampling.GreedyRead` on the device: the first argmax of each processed row, the same ids as
    the host's :func:`~dsi.sampling.greedy_tokens` (the shaped rows are the host's bit for bit); only they cross."""
    top, first = _shaped(rows, read).max(dim=-1)  # [n] each: the maxima and their first indices
    numbers = torch.cat([_usable(top), first.to(torch.float64)]).cpu().numpy()
    _refuse_unusable(numbers[: len(first)], len(first))
    return numbers[len(first):].astype(np.int64)


def distribution(rows: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampled laws ``[n, V]`` (float32) of logit rows ``[n, V]`` (usable: :func:`check_rows`; on any device):
    temperature, min_p, top-k and top-p, each row as :func:`dsi.sampling.process_logits` processes it; a float64
    row (shaped by :func:`shape_rows`) is shifted by its maximum in float64 and then rounded, as the host does."""
    return _laws(rows, params)[0]


def _laws(rows: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`distribution`'s laws, and each row's maximum and first argmax (``[n]`` each, from one reduction;
    temperature, min_p, top-k and top-p keep the order of the logits they are given, so that is also each law's
    greedy token). Nothing is read on the host: a row that can make no law (a NaN, or -inf only) gives some
    law of in-range numbers, and its caller refuses it by its maximum (:func:`_usable`)."""
    x = rows if rows.dtype == torch.float64 else rows.to(torch.float32)  # [n, V]; written only out of place
    top, first = x.max(dim=-1)  # [n] each; the first index of the maximum
    law = _shifted(x, top[:, None]).to(torch.float32)  # <= 0, exactly 0 at the maximum
    t = params.temperature
    if _SCALED_T[0] <= t <= _SCALED_T[1]:
        if t != 1.0:
            law.mul_(float(np.float32(1.0 / t)))
    else:
        law = (law.to(torch.float64) / t).to(torch.float32)
    if params.min_p > 0.0:  # compared in float64, as numpy compares a float32 law with np.log's float64
        law.masked_fill_(law.to(torch.float64) < math.log(params.min_p), -math.inf)
    vocab = law.shape[-1]
    if params.top_k and params.top_k < vocab:
        kth = torch.topk(law, params.top_k, dim=-1).values[:, -1:]  # [n, 1]
        law.masked_fill_(law < kth, -math.inf)  # ties with the k-th are kept
    law.exp_()
    law /= law.sum(dim=-1, keepdim=True)
    if params.top_p < 1.0:
        # ordered by the logits themselves (ties of rounded probabilities keep the logits' order; a +inf row's
        # +inf logits first, in id order, as their shares of the mass would be)
        order = torch.argsort(-x, dim=-1, stable=True)  # [n, V], most likely first
        cumulative = torch.cumsum(law.gather(-1, order).to(torch.float64), dim=-1)
        goal = torch.full((law.shape[0], 1), params.top_p, dtype=torch.float64, device=law.device)
        keep = torch.searchsorted(cumulative, goal, right=False) + 1  # [n, 1], at least one token
        kept = torch.arange(vocab, device=law.device)[None] < keep  # [n, V] in sorted order
        mask = torch.zeros_like(kept).scatter_(-1, order, kept)
        law = torch.where(mask, law, 0.0)
        law /= law.sum(dim=-1, keepdim=True)
    return law, top, first


def _shifted(x: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """``x - top`` (``top``: each row's maximum, ``[n, 1]``), where a row whose maximum is +inf takes the softmax's
    limit as its +inf logits grow: they (``inf - inf``: NaN) share the mass as logits of 0, every other one (-inf)
    has none. No host read decides which rows those are; no other usable row holds a NaN here."""
    return (x - top).nan_to_num_(nan=0.0, posinf=math.inf, neginf=-math.inf)


def read_chain(rows: torch.Tensor, chain: ChainRead) -> tuple[np.ndarray, ReadLaws]:
    """What :class:`~dsi.sampling.ChainRead` gives of a sampled chain's rows ``[n, V]`` (on the device), decided
    there: the rows' argmax ids and a :class:`~dsi.sampling.ReadLaws` with the drafts' target probabilities up to
    the first rejection and the one law the decisions read. Two transfers: the rows' checks, argmax ids and
    drafts' probabilities, then the law the host's decisions chose."""
    params = chain.params
    n = rows.shape[0]
    context = chain.tokens
    laws, top, first_max = _laws(_shaped(rows, chain), params)  # [n, V] float32, [n], [n]
    first = len(context) - n + 1  # the absolute position row 0 decides
    drafts = torch.tensor(context[first:first + n - 1], dtype=torch.long, device=laws.device)  # [n - 1]
    picked = laws.gather(-1, drafts[:, None])[:, 0]  # [n - 1]
    numbers = torch.cat([_usable(top), first_max.to(torch.float64), picked.to(torch.float64)]).cpu().numpy()
    _refuse_unusable(numbers[:n], n)
    tokens, picked_probs = numbers[n:2 * n].astype(np.int64), numbers[2 * n:]
    probs, read = decide_chain(lambda j: float(picked_probs[j]), n, chain.draft_probs, params, first)
    return tokens, ReadLaws(n, probs, {read: laws[read].cpu().numpy().astype(LAW_DTYPE, copy=False)})


def bonus_token(rows: torch.Tensor, read: BonusRead) -> int:
    """:class:`~dsi.sampling.BonusRead` on the device: the law of the last row (processed as
    :func:`read_chain`'s), and the token its inverse CDF gives the BONUS uniform (:func:`dsi.sampling.uniform`, from
    the host: :func:`inverse_cdf`). Only the token crosses, with the row's check."""
    law, usable = _last_law(rows, read)
    token = inverse_cdf(law, uniform(read.params.seed, read.position, Purpose.BONUS))
    numbers = torch.stack([usable, token.to(torch.float64)]).cpu().numpy()
    _refuse_unusable(numbers[:1], 1)
    return int(numbers[1])


def draft(rows: torch.Tensor, read: DraftRead) -> tuple[int, DeviceLaw | None]:
    """:class:`~dsi.sampling.DraftRead` on the device: the drafter's last row processed as :func:`read_chain`'s
    rows are. Greedy: the first argmax of the processed row (the host's id, bit for bit) and no law; sampled: the
    token the law's inverse CDF gives the DRAFT uniform (:func:`inverse_cdf`), the token and its probability in one
    transfer with the row's check, and the law left on the device (:class:`DeviceLaw`). A row the request's
    constraint empties drafts nothing (:func:`dsi.sampling.drafting`), as on the host."""
    params = read.params
    with drafting():
        if params.greedy:
            top, token = _shaped(rows[-1:], read).max(dim=-1)  # [1] each: the maximum and its first index
            numbers = torch.cat([_usable(top), token.to(torch.float64)]).cpu().numpy()
            _refuse_unusable(numbers[:1], 1)
            return int(numbers[1]), None
        law, usable = _last_law(rows, read)
    token = inverse_cdf(law, uniform(params.seed, read.position, Purpose.DRAFT))
    prob = law.gather(0, token.reshape(1))[0]  # a tensor index, not law[token]: that reads the token to the host
    numbers = torch.stack([usable, token.to(torch.float64), prob.to(torch.float64)]).cpu().numpy()
    _refuse_unusable(numbers[:1], 1)
    return int(numbers[1]), DeviceLaw(law, int(numbers[1]), float(numbers[2]))


def _last_law(rows: torch.Tensor, read: LastRowRead) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled law ``[V]`` (float32, on the rows' device) of the last of ``rows``, processed as
    :func:`read_chain`'s rows are, and whether the row could make one (a 0-d :func:`_usable`, not yet read)."""
    law, top, _ = _laws(_shaped(rows[-1:], read), read.params)
    return law[0], _usable(top)[0]


def _shaped(rows: torch.Tensor, read: RowsRead, check: bool = True) -> torch.Tensor:
    """The last ``n`` rows of a forward over ``read.tokens`` after the processors before temperature
    (:func:`shape_rows`, float64; the rows checked first where ``check``: :func:`check_rows`) where they can move
    the argmax; else the rows as they are (checked by their caller with the numbers it reads)."""
    params = read.params
    if not params.moves_argmax:
        return rows
    if check:  # the processors read rows on the host anyway; a broken row is refused before they run
        check_rows(rows)
    return shape_rows(rows, params, read.tokens, read.prompt_len, read.stop_ids)


def inverse_cdf(law: torch.Tensor, u: float) -> torch.Tensor:
    """The token (a 0-d tensor on the law's device: nothing crosses) that the inverse CDF of ``law`` ``[V]`` gives
    the uniform ``u``: a running sum in float64, as :func:`dsi.sampling.sample_from`'s, and the last token of
    positive probability at or before where it reaches ``u`` times the mass (rounding may land past the mass or
    on a zero-probability token; the first positive one where none is before). Always an id of the law, even of
    a law of NaN (an unusable row's, refused by the caller): an id out of range would fault the device."""
    vocab = law.shape[0]
    cdf = torch.cumsum(law.to(torch.float64), dim=0)
    index = torch.searchsorted(cdf, (u * cdf[-1]).reshape(1), right=True).clamp_(max=vocab - 1)  # [1]
    ids = torch.arange(vocab, device=law.device)
    positive = law > 0
    before = torch.where(positive & (ids <= index), ids, -1).max()
    return torch.where(before >= 0, before, torch.where(positive, ids, vocab - 1).min())


class DeviceLaw:
    """A drafter's processed law ``q`` ``[V]`` (float32) kept on its device (:func:`draft`). ``q[token]`` of the
    drafted token is the number that crossed with it; any other read (another id, ``np.asarray(q)``: a
    rejection's residual, a tree's walk) brings the whole law to the host, once. Pickled as that host array."""

    __slots__ = ("_law", "_token", "_prob", "_host")

    def __init__(self, law: torch.Tensor, token: int, prob: float) -> None:
        self._law = law
        self._token = token
        self._prob = LAW_DTYPE(prob)
        self._host: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._law.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(LAW_DTYPE)

    def __len__(self) -> int:
        return self._law.shape[0]

    def host(self) -> np.ndarray:
        """The law on the host (copied once; the same array afterwards)."""
        if self._host is None:
            self._host = self._law.cpu().numpy().astype(LAW_DTYPE, copy=False)
        return self._host

    def __getitem__(self, index):
        if isinstance(index, int | np.integer) and int(index) == self._token:
            return self._prob
        return self.host()[index]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self.host() if dtype is None else self.host().astype(dtype, copy=False)
        return out.copy() if copy else out

    def __reduce__(self):
        return np.asarray, (self.host(),)


def with_logprobs(rows: torch.Tensor, read: LogprobsRead) -> tuple[object, ReadLogprobs]:
    """:class:`~dsi.logprobs.LogprobsRead` on the device: its decisions as without logprobs (:data:`READERS`),
    and of each row's log-probabilities (in the read's mode, as :func:`dsi.logprobs.logprob_rows` makes them) only
    its ``top`` most likely tokens (ties in id order) and the tokens its decision can commit: a greedy row's argmax,
    non-SI's draw, a sampled chain's accepted drafts. The row whose law a sampled chain's decisions read (the engine
    draws its correction or bonus from it) crosses whole. One transfer for the numbers."""
    decisions = read.decisions
    got = READERS[type(decisions)](rows, decisions)
    rows = rows[-1:] if isinstance(decisions, LastRowRead) else rows
    n = rows.shape[0]
    if isinstance(decisions, GreedyRead):  # a greedy row commits its argmax
        committed: list[int | None] = [int(t) for t in got]
    elif isinstance(decisions, BonusRead):  # non-SI's draw
        committed = [int(got)]
    else:  # a sampled chain: row j its draft where accepted; the engine draws at the row whose law it reads
        first = len(decisions.tokens) - n + 1
        committed = [int(decisions.tokens[first + j]) for j in range(n - 1)] + [None]
    whole = set(got[1].laws) if isinstance(decisions, ChainRead) else set()  # those rows cross whole
    values, lse = _logprob_values(rows, decisions, read.mode)  # [n, V] float32, [n] float64
    top = min(read.top, values.shape[1])
    ids = torch.tensor([0 if t is None else t for t in committed], dtype=torch.long, device=values.device)
    parts = [lse, values[torch.arange(n, device=values.device), ids].to(torch.float64)]
    if top:
        top_ids, top_values = _top(values, top)  # [n, top] each
        parts += [top_ids.flatten().to(torch.float64), top_values.flatten().to(torch.float64)]
    numbers = torch.cat(parts).cpu().numpy()  # one transfer; exact: ids < 2**53, float32 values widened
    lse_host, picked = numbers[:n], numbers[n:2 * n]
    best_ids = numbers[2 * n:2 * n + n * top].astype(np.int64).reshape(n, top)
    best_values = numbers[2 * n + n * top:].astype(np.float32).reshape(n, top)
    out: list[TopLogprobs | tuple[np.ndarray, float]] = []
    for j in range(n):
        if j in whole:
            out.append((values[j].cpu().numpy(), float(lse_host[j])))
            continue
        known = {} if committed[j] is None else {committed[j]: float(np.float32(picked[j])) - lse_host[j]}
        best = tuple((int(i), float(v) - lse_host[j]) for i, v in zip(best_ids[j], best_values[j]))
        out.append(TopLogprobs(best, known))
    return got, ReadLogprobs(tuple(out))


def _logprob_values(rows: torch.Tensor, read, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability rows as :func:`dsi.logprobs.logprob_rows` makes them, on the device: float32 values
    ``[n, V]`` and their float64 log-normalisers ``[n]`` (a value minus its row's normaliser is the
    log-probability). Raw: the logits; processed greedy: the rows after the processors before temperature;
    processed sampled: the log of the law (normaliser 0)."""
    if mode == "processed":
        rows = _shaped(rows, read, check=False)  # checked by the decisions' reader
        if not read.params.greedy:
            law = distribution(rows, read.params)
            return torch.log(law), torch.zeros(law.shape[0], dtype=torch.float64, device=law.device)
    x = rows.to(torch.float32)
    top = x.max(dim=-1, keepdim=True).values  # [n, 1]
    shifted = _shifted(x, top)  # [n, V]
    total = torch.exp(shifted).sum(dim=-1, dtype=torch.float64)  # [n], each >= 1
    infinite = top == math.inf
    values = torch.where(infinite, shifted, x)
    return values, torch.where(infinite, 0.0, top)[:, 0].to(torch.float64) + torch.log(total)


def _top(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids ``[n, k]`` of each row's ``k`` largest ``values`` and those values, largest first, ties in id order
    (also at the k-th: every id tied with it is considered, the lower ids kept), as :func:`dsi.logprobs.top_ids`."""
    kth = torch.topk(values, k, dim=-1).values[:, -1:]  # [n, 1], the k-th largest value
    # every id at least the k-th (ties included) first, by value then id: a stable sort of -value over ids in order
    key = torch.where(values >= kth, -values, math.inf)
    order = torch.sort(key, dim=-1, stable=True).indices[:, :k]  # [n, k]
    return order, values.gather(-1, order)


# how each reader of rows (dsi.sampling.RowsRead, dsi.logprobs.LogprobsRead) is read on the device
READERS = {ChainRead: read_chain, GreedyRead: greedy_ids, BonusRead: bonus_token, DraftRead: draft,
           LogprobsRead: with_logprobs}
