"""The built-in sequence data set, ``markov_text``: variable-length token sequences for
next-token prediction, generated from a constant seed (never downloaded).

The "language" is a second-order Markov chain over a vocabulary of 32 tokens:
token 0 is padding, 1 starts every sequence, 2 ends it, and each pair of previous
tokens has a few likely successors (Dirichlet-sparse transition rows), so a model
that uses the context beats the unigram baseline by a wide margin. Sequences hold
8 to 48 tokens; each example is one sequence padded to 48 with token 0:

    features: int32 [48]  tokens 0 .. 46 of the sequence (1 first)
    labels:   int32 [48]  tokens 1 .. 47: the next token at every position
    weights:  float32 [48] 1 where the label is a real token, 0 on padding

so the loss and the precision are per real token, and the number of tokens an
example contributes varies from 7 to 47.
"""
from __future__ import annotations

import functools

import numpy as np

from tower_train.data.array_source import ArraySource

VOCABULARY = 32
LENGTH = 48  # tokens per padded example
PAD, START, END = 0, 1, 2
_SEED = 20_261_122  # the data set is a constant: nothing to do with the training --seed
_TRAIN, _EVAL = 8_000, 1_000
_MIN_TOKENS, _MAX_TOKENS = 8, LENGTH  # real tokens of a sequence, START and END included
_SPARSITY = 0.1  # Dirichlet concentration of a transition row: small = few likely successors


@functools.cache
def _arrays() -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(_SEED)
    words = VOCABULARY - 3  # the tokens a sequence may hold between START and END
    transitions = rng.dirichlet(np.full(words, _SPARSITY), size=(VOCABULARY, VOCABULARY))
    cumulative = transitions.cumsum(axis=-1)
    n = _TRAIN + _EVAL
    lengths = rng.integers(_MIN_TOKENS, _MAX_TOKENS + 1, n)
    tokens = np.zeros((n, LENGTH + 1), np.int32)
    tokens[:, 0] = START
    previous = np.full(n, START)  # the first context is (START, START)
    for t in range(1, LENGTH + 1):  # all sequences a step at a time; cut to length below
        draw = rng.random((n, 1))
        word = (cumulative[previous, tokens[:, t - 1]] < draw).sum(axis=1).clip(max=words - 1)
        previous = tokens[:, t - 1].copy()
        tokens[:, t] = 3 + word
    position = np.arange(LENGTH + 1)[None, :]
    tokens[position == (lengths - 1)[:, None]] = END  # `length` tokens: START, words, END
    tokens[position >= lengths[:, None]] = PAD
    features, labels = tokens[:, :-1], tokens[:, 1:]
    weights = (np.arange(LENGTH)[None, :] < (lengths - 1)[:, None]).astype(np.float32)
    arrays = (features, labels, weights)
    for array in arrays:
        array.flags.writeable = False
    return tuple(a[:_TRAIN] for a in arrays) + tuple(a[_TRAIN:] for a in arrays)


def markov_text() -> ArraySource:
    """The built-in sequence data set (module docstring), for --model=tiny_transformer."""
    train_x, train_y, train_w, eval_x, eval_y, eval_w = _arrays()
    return ArraySource(train_x, train_y, train_w, eval_x, eval_y, eval_w,
                       num_classes=VOCABULARY, name="markov_text")


def unigram_precision() -> float:
    """Held-out precision @ 1 of always predicting the training set's most frequent real token:
    the baseline a model must beat."""
    train_x, train_y, train_w, _, eval_y, eval_w = _arrays()
    counts = np.bincount(train_y[train_w > 0], minlength=VOCABULARY)
    return float(((eval_y == counts.argmax()) * eval_w).sum() / eval_w.sum())
