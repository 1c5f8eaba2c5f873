"""Networks for tower-train: the base class, the registry and the built-in models."""
from models.base import TowerModel, l2_loss
from models.registry import model_class, model_names, register
from models import cifar10_cnn  # noqa: F401  (registers itself)
from models import resnet20  # noqa: F401  (registers itself)

__all__ = ["TowerModel", "l2_loss", "model_class", "model_names", "register"]
