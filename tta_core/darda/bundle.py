"""The DARDA bundle: one safetensors file with the whole offline phase, next to the model card.

Tensors: `subnet/<corruption>/<state key>` (the sub-networks), `accuracy` (a_ij),
`noise`, `fingerprints`, `centroids`, `raw_centroids`, and the weights of the encoder
(`encoder/...`), the encoder without extractor (`raw_encoder/...`) and the two S
(`s/...`, `raw_s/...`). Metadata (JSON): the model fingerprint and the adapted tensors'
names and shapes (a bundle of another model is refused in one line), the corruption names,
the encoder and S configs, `offline` (every OfflineConfig field), `data` (where the
labelled images came from: rendered signs, or the folder with its meta.json fingerprint;
the training corruptions, images per corruption, own-corruption accuracy a_ii) and the
report (with the Eq. 16 probe). Bundles written before `offline` / `data` existed load
with both empty. Written atomically by tta_core.darda.store; nothing is unpickled. A load
followed by a save gives the same bytes.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from tta_core.darda.offline import Offline
from tta_core.darda.store import load_tensors, model_fingerprint, save_tensors
from tta_core.darda.subnet import SubnetEncoder, SubnetEncoderConfig
from tta_core.domain.bank import adapted_tensors
from tta_core.domain.encoder import CorruptionEncoder, EncoderConfig, RawCorruptionEncoder
from tta_core.errors import InputError, one_line

FORMAT = "tta.darda_bundle"
VERSION = 1


def expect_for(model: nn.Module) -> dict[str, Any]:
    """Metadata a bundle must carry to fit `model` (fingerprint of the frozen weights and
    the sub-network tensors' names and shapes)."""
    live = adapted_tensors(model)
    return {"fingerprint": model_fingerprint(model, live),
            "adapted": {k: list(v.shape) for k, v in live.items()}}


def _prefixed(prefix: str, module: nn.Module) -> dict[str, Tensor]:
    return {f"{prefix}/{k}": v for k, v in module.state_dict().items()}


def save_bundle(off: Offline, model: nn.Module, path: str | Path) -> None:
    """Write the offline phase of `model` (source weights in place) to `path`."""
    tensors: dict[str, Tensor] = {"accuracy": off.accuracy, "noise": off.noise,
                                  "fingerprints": off.fingerprints, "centroids": off.centroids,
                                  "raw_centroids": off.raw_centroids}
    for name, state in off.states.items():
        tensors.update({f"subnet/{name}/{k}": v for k, v in state.items()})
    for prefix, mod in (("encoder", off.encoder), ("raw_encoder", off.raw_encoder),
                        ("s", off.s), ("raw_s", off.raw_s)):
        tensors.update(_prefixed(prefix, mod))
    meta = {**expect_for(model), "names": off.names, "encoder": asdict(off.encoder.config),
            "s": asdict(off.s.config), "report": off.report, "offline": off.config,
            "data": off.data}
    save_tensors(path, tensors, meta, FORMAT, VERSION)


def _module(tensors: dict[str, Tensor], prefix: str, module: nn.Module) -> nn.Module:
    state = {k[len(prefix) + 1:]: v for k, v in tensors.items() if k.startswith(prefix + "/")}
    module.load_state_dict(state)
    return module.eval().requires_grad_(False)


def load_bundle(path: str | Path, model: nn.Module) -> Offline:
    """The bundle at `path` for `model`; InputError (one line, naming the file) when it is
    not one or was made for another model."""
    tensors, meta = load_tensors(path, expect_for(model), FORMAT, VERSION, "darda bundle")
    try:
        names = [str(n) for n in meta["names"]]
        keys = list(meta["adapted"])
        states = {n: {k: tensors[f"subnet/{n}/{k}"] for k in keys} for n in names}
        ecfg, scfg = EncoderConfig(**meta["encoder"]), SubnetEncoderConfig(**meta["s"])
        enc = _module(tensors, "encoder", CorruptionEncoder(ecfg))
        raw = _module(tensors, "raw_encoder", RawCorruptionEncoder(ecfg))
        s = _module(tensors, "s", SubnetEncoder(scfg))
        raw_s = _module(tensors, "raw_s", SubnetEncoder(scfg))
        off = Offline(names, states, tensors["accuracy"], tensors["noise"],
                      tensors["fingerprints"], enc, raw, tensors["centroids"],
                      tensors["raw_centroids"], s, raw_s, dict(meta.get("report", {})),
                      dict(meta.get("offline") or {}), dict(meta.get("data") or {}))
        off.offline_config()  # a recorded config must be one
    except KeyError as exc:
        raise InputError(f"darda bundle {path}: missing entry {exc}") from None
    except (ValueError, TypeError, RuntimeError) as exc:
        raise InputError(f"darda bundle {path}: {one_line(exc)}") from None
    if off.accuracy.shape != (len(names), len(names)) or len(off.centroids) != len(names):
        raise InputError(f"darda bundle {path}: accuracy {tuple(off.accuracy.shape)} / "
                         f"centroids {tuple(off.centroids.shape)} do not fit {len(names)} "
                         "sub-networks")
    return off
