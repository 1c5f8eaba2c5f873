"""ResNet-50 (He et al. 2016) as Keras ships it: `keras.applications.ResNet50`, untrained, for
224x224x3 inputs and 1,000 classes (ImageNet's shapes), 25,636,712 parameters.

A real-sized network beside the small CIFAR ones, so that a GPU's figures are not all launch
overhead, and the network users compare with Keras's own `fit` (docs/performance.md). It trains
on `--dataset=synthetic_imagenet` (tower_train/data/imagenet_shaped.py), or on any data set of
224x224x3 float32 images and labels in 0..999.

Keras's network, unchanged except its last activation: it returns logits (no softmax), and its
loss is softmax cross-entropy from them, as tower-train's other networks compute it. Its
BatchNormalization layers are Keras's own, so --sync_bn does not reach them.
"""
from __future__ import annotations

import keras

from tower_train.models.registry import register

IMAGE_SHAPE = (224, 224, 3)
NUM_CLASSES = 1000


@register("resnet50", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
def resnet50() -> keras.Model:
    """Keras's ResNet-50, untrained (weights=None: nothing is downloaded), returning logits."""
    return keras.applications.ResNet50(weights=None, input_shape=IMAGE_SHAPE, classes=NUM_CLASSES,
                                       classifier_activation=None)
