"""Models, inputs and gradients shared by unit tests (torch only, no rclpy)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torchvision.models import resnet18

from helpers import CARD


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Mean prediction entropy (Tent's loss)."""
    p = logits.softmax(1)
    return -(p * p.clamp_min(1e-12).log()).sum(1).mean()


def grads_by_name(model: nn.Module, x: torch.Tensor, ctx=None) -> dict[str, torch.Tensor]:
    """Every parameter's entropy gradient on `x`, the forward run inside `ctx` if given."""
    model.zero_grad(set_to_none=True)
    if ctx is None:
        loss = entropy(model(x))
    else:
        with ctx:
            loss = entropy(model(x))
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def flat_grads(model: nn.Module, x: torch.Tensor, ctx=None) -> torch.Tensor:
    """grads_by_name flattened into one float64 vector."""
    return torch.cat([g.double().flatten() for g in grads_by_name(model, x, ctx).values()])


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))


def shipped_net() -> tuple[nn.Module, torch.Tensor]:
    """The shipped small ResNet (trained weights), train-mode BN, 16 images of 32 px."""
    from tta_core.model.source import load_source

    model, card = load_source(CARD)
    g = torch.Generator().manual_seed(0)
    return model.train(), torch.rand(16, 3, card.image_size, card.image_size, generator=g)


def resnet18_64px() -> tuple[nn.Module, torch.Tensor]:
    """torchvision ResNet-18 (seeded random weights), 8 images of 64 px."""
    torch.manual_seed(0)
    return resnet18(num_classes=10).train(), torch.randn(8, 3, 64, 64)


MODELS = {"shipped": shipped_net, "resnet18": resnet18_64px}


def small_source() -> nn.Module:
    """The shipped small ResNet, as its card loads it."""
    from tta_core.model.source import load_source

    model, _ = load_source(CARD)
    return model


def signs_batch(n: int = 16, seed: int = 7) -> torch.Tensor:
    """`n` synthetic 32 px sign images, normalized as the shipped card says."""
    from tta_core.data.preprocess import images_to_tensor
    from tta_core.data.signs import make_signs
    from tta_core.model.source import load_card

    card = load_card(CARD)
    data = make_signs(n, 32, seed=seed)
    return images_to_tensor(data.images, card.mean, card.std)


def randomize_gates(master, seed: int = 0, std: float = 0.5):
    """Gates of an ElasticDNN GatedModel with random fc weights and fc2 biases in
    [0.2, 1.2] (fresh gates are all exactly 1, so every channel ties)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for gate in master.gates.values():
            for fc in (gate.fc1, gate.fc2):
                fc.weight.copy_(torch.randn(fc.weight.shape, generator=gen) * std)
            gate.fc2.bias.copy_(0.2 + torch.rand(gate.fc2.bias.shape, generator=gen))
    return master


def settle_bn(model: nn.Module, shape: tuple[int, ...], seed: int = 0) -> nn.Module:
    """Random-init torchvision nets explode in eval mode (running stats 0/1): give their
    BNs the statistics of a few random batches so logits stay moderate, then eval."""
    gen = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.momentum = None  # cumulative average
    model.train()
    with torch.no_grad():
        for _ in range(2):
            model(torch.randn(shape, generator=gen))
    return model.eval()


def tiny_stream(batch_size: int = 4):
    """Two fabricated 'domains' of random sign-sized images: clean and noisy."""
    from tta_core.eval.bench_inputs import batches_from_arrays, images_to_input

    rng = np.random.default_rng(0)
    clean = rng.integers(0, 256, (12, 32, 32, 3), dtype=np.uint8)
    noisy = np.clip(clean + rng.normal(0, 60, clean.shape), 0, 255).astype(np.uint8)
    images = np.concatenate([clean, noisy])
    labels = np.concatenate([np.arange(12) % 16, np.arange(12) % 16])
    domains = ["clean"] * 12 + ["gaussian_noise"] * 10 + ["clean"] * 2  # a recurrence
    x = images_to_input(images, {})
    return batches_from_arrays(x, labels, domains, batch_size)


def make_model():
    """A seeded SmallResNet with a sharpened head: confident predictions (EATA's filter
    lets them in)."""
    from tta_core.model.zoo import SmallResNet

    torch.manual_seed(0)
    model = SmallResNet(num_classes=16)
    with torch.no_grad():
        model.fc.weight.mul_(30.0)
    return model


def assert_replay_skips_units(staged, stage: int, x, replay: dict, full) -> None:
    """`staged.forward_from(stage, x, replay)` equals the full forward `full` without
    running any replayed unit again."""
    calls: list[int] = []
    hs = [staged.units[u].module.register_forward_hook(
        lambda *_a, u=u: calls.append(u)) for u in replay]
    try:
        with torch.no_grad():
            got = staged.forward_from(stage, x, replay)
    finally:
        for h in hs:
            h.remove()
    assert not calls, f"replayed units ran again: {calls}"
    torch.testing.assert_close(got, full, rtol=0.0, atol=1e-5)
