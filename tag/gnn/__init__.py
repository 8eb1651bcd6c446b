"""Joint GNN over op-groups and devices: encoding, layers, policy/value network, predictor."""

from .features import SCHEMA, JointContext
from .layers import JointConv
from .model import NetConfig, TagNet
from .predictor import DEFAULT_CHECKPOINT, PlanHeadPrior, Predictor, load_net, save_checkpoint
from .transforms import JointNormalize

__all__ = ["DEFAULT_CHECKPOINT", "JointContext", "JointConv", "JointNormalize", "NetConfig", "PlanHeadPrior", "Predictor",
           "SCHEMA", "TagNet", "load_net", "save_checkpoint"]
