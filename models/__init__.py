"""Networks for tower-train: the base class, the registry and the built-in models."""
from tower_train.models.base import TowerModel, l2_loss
from tower_train.models.registry import model_class, model_names, register, registered_loss
from tower_train.models import cifar10_cnn  # registers itself
from tower_train.models import resnet20  # registers itself
from tower_train.models import resnet50  # registers itself
from tower_train.models import tiny_transformer  # registers itself

# The modules are listed so that pyflakes, which ignores noqa, sees their imports used.
__all__ = ["TowerModel", "l2_loss", "model_class", "model_names", "register", "registered_loss",
           "cifar10_cnn", "resnet20", "resnet50", "tiny_transformer"]
