"""Checkpoints: the model with its config and tokenizer (enough to translate), plus the
training state for exact resume (optimizer, schedule step, RNG states, data position)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from nmtserve.errors import CheckpointError
from nmtserve.tokenizer import MarianTokenizer, Tokenizer, from_payload
from nmtserve.training.model import EncoderDecoder, ModelConfig

FORMAT_VERSION = 1


@dataclass
class LoadedModel:
    model: EncoderDecoder
    tokenizer: Tokenizer | MarianTokenizer
    payload: dict  # everything else saved: metrics, train config, step, data source


def save(path: Path, payload: dict) -> None:
    """Write atomically: a crash mid-write never leaves a truncated `last.pt`. Makes the directory if need be."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save({"format_version": FORMAT_VERSION, **payload}, tmp)
    os.replace(tmp, path)


def read(path: str | Path) -> dict:
    """The raw payload, with one-line errors for missing, corrupt or foreign files."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # torch raises many types for a damaged zip/pickle
        raise CheckpointError(f"{path}: not a readable checkpoint ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    if not isinstance(payload, dict) or "model" not in payload or "model_config" not in payload:
        raise CheckpointError(f"{path}: not an nmtserve checkpoint (no model or model_config)")
    if payload.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format {payload.get('format_version')!r}, expected {FORMAT_VERSION}")
    return payload


def load_model(path: str | Path, device="cpu") -> LoadedModel:
    """Model (in eval mode) and tokenizer from a checkpoint."""
    payload = read(path)
    config = ModelConfig(**payload["model_config"])
    model = EncoderDecoder(config)
    try:
        model.load_state_dict(payload["model"])
    except RuntimeError as e:
        raise CheckpointError(f"{path}: weights do not fit the recorded config ({str(e).splitlines()[0][:200]})") from None
    model.to(device).eval()
    return LoadedModel(model, from_payload(payload["tokenizer"]), payload)


def average(paths: list[str | Path], out: str | Path) -> Path:
    """Average the weights of several checkpoints of one run into `out` (the first one's metadata)."""
    if not paths:
        raise CheckpointError("checkpoint averaging needs at least one checkpoint")
    payloads = [read(p) for p in paths]
    first = payloads[0]
    for p, payload in zip(paths[1:], payloads[1:]):
        if payload["model_config"] != first["model_config"]:
            raise CheckpointError(f"{p}: model config differs from {paths[0]}; only checkpoints of one run can be averaged")
    averaged = {}
    for name, tensor in first["model"].items():
        if tensor.is_floating_point():
            averaged[name] = sum(pl["model"][name].double() for pl in payloads).div(len(payloads)).to(tensor.dtype)
        else:
            averaged[name] = tensor
    keep = {k: first[k] for k in ("model_config", "tokenizer", "special_ids", "train_config", "data") if k in first}
    save(Path(out), {**keep, "model": averaged, "step": first.get("step"), "averaged_from": [str(p) for p in paths]})
    return Path(out)
