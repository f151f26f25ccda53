"""Token-id arguments every model must refuse in Python, before native code (llama.cpp, tokenizers,
torch) or a user's function sees them, with the :class:`~dsi.errors.ConfigError` message each gives
(:func:`dsi.models.base.check_token_ids`)."""

from __future__ import annotations

import numpy as np


def bad_ids(vocab: int, name: str = "ids") -> list[tuple[object, str]]:
    """(argument, message pattern) pairs for a model of ``vocab`` tokens whose argument is called ``name``."""
    return [
        ([vocab], rf"{name}\[0\]={vocab} is outside the vocabulary \[0, {vocab}\)"),
        ([3, -1], rf"{name}\[1\]=-1 is outside the vocabulary \[0, {vocab}\)"),
        ([2**70], rf"{name}\[0\]=1180591620717411303424 is outside the vocabulary"),
        ([1.5], rf"{name}\[0\]=1.5 \(float\) is not a token id"),
        (["a"], rf"{name}\[0\]='a' \(str\) is not a token id"),
        ([None], rf"{name}\[0\]=None \(NoneType\) is not a token id"),
        ([True], rf"{name}\[0\]=True \(bool\) is not a token id"),
        ([[1, 2]], rf"{name}\[0\]=\[1, 2\] \(list\) is not a token id"),
        (np.array([1.0, 2.0]), rf"{name} is a numpy array of dtype float64"),
        (np.array([[1, 2]]), rf"{name} is a numpy array of dtype int64 and shape \(1, 2\)"),
        (5, rf"{name}=5 \(int\) must be a sequence of token ids"),
        ("hello", rf"{name}='hello' \(str\) must be a sequence of token ids"),
        (None, rf"{name}=None \(NoneType\) must be a sequence of token ids"),
    ]
