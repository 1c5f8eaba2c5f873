"""A small decoder-only transformer (GPT-style) for next-token prediction.

Token ids [B, T] -> logits [B, T, vocabulary], one prediction per position, so
the loss is per token ([B, T]) and the data's weights (0 on padding) decide
which tokens count. Token and learned position embeddings, `layers` pre-norm
blocks of causal multi-head self-attention and a ReLU MLP, each with a
residual connection, then a final layer norm and a dense read-out. The
vocabulary is `num_classes`: inputs and targets are the same tokens.

Each block runs through `run_block`, so `--recompute` recomputes a block's
attention and MLP activations in the backward pass. About 0.1 M parameters
with the defaults and a vocabulary of 32.
"""
from __future__ import annotations

import keras
import tensorflow as tf

from tower_train.models.base import TowerModel, l2_loss
from tower_train.models.registry import register

_WEIGHT_DECAY = 1e-4  # on the MLP and read-out kernels; attention, embeddings and norms are not decayed


class _DecoderBlock(keras.layers.Layer):
    """x + attention(norm(x)), then + mlp(norm(x)); attention sees earlier positions only."""

    def __init__(self, width: int, heads: int, **kwargs):
        super().__init__(**kwargs)
        self.attention_norm = keras.layers.LayerNormalization(epsilon=1e-5)
        self.attention = keras.layers.MultiHeadAttention(heads, key_dim=width // heads)
        self.mlp_norm = keras.layers.LayerNormalization(epsilon=1e-5)
        self.expand = keras.layers.Dense(4 * width, activation="relu")
        self.project = keras.layers.Dense(width)

    def call(self, x: tf.Tensor, training: bool = False) -> tf.Tensor:
        normed = self.attention_norm(x)
        x = x + self.attention(normed, normed, use_causal_mask=True, training=training)
        return x + self.project(self.expand(self.mlp_norm(x)))


@register("tiny_transformer")
class TinyTransformer(TowerModel):
    """Decoder-only transformer: token ids [B, T] (T <= max_length) -> logits [B, T, num_classes]."""

    def __init__(self, num_classes: int, layers: int = 2, width: int = 64, heads: int = 4,
                 max_length: int = 64, **kwargs):
        super().__init__(num_classes, **kwargs)
        self.token_embedding = keras.layers.Embedding(num_classes, width)
        self.position_embedding = keras.layers.Embedding(max_length, width)
        # Named: Keras would name them `__decoder_block`, which TensorFlow refuses as a root name
        # scope, so a call traced outside any other scope (a plain tf.function) would fail.
        self.blocks = [_DecoderBlock(width, heads, name=f"decoder_block_{i}") for i in range(layers)]
        self.norm = keras.layers.LayerNormalization(epsilon=1e-5)
        self.logits = keras.layers.Dense(num_classes)

    def call(self, tokens: tf.Tensor, training: bool = False) -> tf.Tensor:
        positions = tf.range(tf.shape(tokens)[1])
        x = self.token_embedding(tokens) + self.position_embedding(positions)[tf.newaxis]
        for block in self.blocks:
            x = self.run_block(block, x, training)
        return self.logits(self.norm(x))

    def regularization(self) -> tf.Tensor:
        kernels = [self.logits.kernel] + [d.kernel for b in self.blocks for d in (b.expand, b.project)]
        return _WEIGHT_DECAY * tf.add_n([l2_loss(k) for k in kernels])
