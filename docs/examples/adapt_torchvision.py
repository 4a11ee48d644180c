"""Adapt a torchvision ResNet-18 online, without labels, on a shifting camera stream.

The Getting started page shows this file; test/system/test_docs.py runs it. Put your own
trained weights in with `model.load_state_dict(...)` and your frames in place of `stream`.
"""

import torch
import torchvision

from tta_core.data.preprocess import images_to_tensor
from tta_core.data.streams import StreamSpec, build_stream
from tta_core.registry import build_method

model = torchvision.models.resnet18(num_classes=10)  # random weights here: load yours
stream = build_stream(StreamSpec(samples_per_domain=16, corruptions=("fog", "snow"),
                                 num_classes=10))  # synthetic traffic signs, 32 px
method = build_method("adashadow", model, input_shape=(3, 32, 32), sigma=0.5)
for batch in stream.batches(8):
    x = images_to_tensor(batch.images, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    result = method.step(x)  # tta_core.api.StepResult: logits, phase times, the plan
    correct = (result.logits.argmax(1) == torch.as_tensor(batch.labels)).sum().item()
    print(f"{batch.domain:8s} {correct}/{len(x)} right, {result.units_updated} units "
          f"updated, {result.times.total_ms:.0f} ms (budget {result.budget_ms:.0f} ms)")
method.close()
