"""LoRA adapters: PEFT directories checked against the model, up to --max-loras resident in
slots, and one grouped product per linear layer that applies each row's own adapter.

Every target linear layer holds its slots' A matrices stacked, [L*R, in], and their B
matrices transposed and scaled, [L*R, out] (L slots of rank R = --max-lora-rank; a rank-r
adapter fills the first r rows of its slot, the rest stay zero). A step's rows pick their
slot's R columns: y += (x @ A^T, other slots' columns cleared) @ B. That is two matmuls
per layer whatever the number of adapters in the batch (punica's "shrink" and "expand" as
dense products), over the slots up to the highest one in use, and none in a step without
adapter rows. A per-adapter loop costs two matmuls and two index ops per adapter per layer,
each ~10 us of dispatch on CPU: 210 layers of SmolLM2 made that the larger cost.

Identity: an adapter's digest is the sha256 of its config and weights, so two directories
with the same contents are one adapter, and one name reloaded with other weights is another
(the gateway mixes the digest into block hashes).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load

from common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from common.executor_description import LoraAdapterInfo

log = structlog.get_logger(__name__)

# The projections of Llama-family decoder layers (vLLM's packed-module names unpacked).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_NAME_CHARS = 128
# PEFT's saved keys: base_model.model.<module>.lora_A.weight (an adapter name may follow A/B).
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")
# Config options that change the computation beyond x @ A^T @ B^T * scale: refused, not ignored.
_UNSUPPORTED = {
    "use_dora": "DoRA", "modules_to_save": "modules_to_save", "rank_pattern": "rank_pattern",
    "alpha_pattern": "alpha_pattern", "fan_in_fan_out": "fan_in_fan_out",
    "trainable_token_indices": "trainable_token_indices", "lora_bias": "lora_bias",
    "use_qalora": "QALoRA", "layer_replication": "layer_replication",
}


@dataclass(frozen=True, slots=True)
class LoraSpec:
    max_loras: int  # resident adapters (slots)
    max_rank: int


class LoraBatch:
    """A step's row-to-slot mask, shared by every LoraLinear; None between steps and in
    steps without adapter rows."""

    __slots__ = ("unselected", "width")

    def __init__(self) -> None:
        # [T, width], True where the column belongs to another slot than the row's (cleared
        # by a fill, not a multiply: an overflow there must not become NaN in this row).
        self.unselected: torch.Tensor | None = None
        self.width = 0  # columns in use: R x (the highest slot in use + 1)


class LoraLinear(torch.nn.Module):
    """A linear layer (nn.Linear or PackedLinear) plus its slots' adapters. Its parameters
    are the layer's own, under the same names: the state_dict is unchanged."""

    base: Any
    lora_a: torch.Tensor  # [L*R, in]
    lora_b: torch.Tensor  # [L*R, out]

    def __init__(self, base: Any, spec: LoraSpec, batch: LoraBatch) -> None:
        super().__init__()
        self.__dict__["base"] = base  # not a submodule: its parameters are registered here
        self.weight = base.weight
        self.bias = base.bias
        self.in_features = int(base.in_features)
        self.out_features = int(base.out_features)
        weight = base.weight
        rows = spec.max_loras * spec.max_rank
        self.register_buffer("lora_a", weight.new_zeros(rows, self.in_features),
                             persistent=False)
        self.register_buffer("lora_b", weight.new_zeros(rows, self.out_features),
                             persistent=False)
        self.batch = batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x)
        unselected = self.batch.unselected
        if unselected is None:
            return out
        width = self.batch.width
        rows = x.reshape(-1, self.in_features)
        shrunk = F.linear(rows, self.lora_a[:width]).masked_fill_(unselected, 0)  # [T, width]
        out.view(-1, self.out_features).addmm_(shrunk, self.lora_b[:width])
        return out


@dataclass(frozen=True, slots=True)
class PeftAdapter:
    """An adapter read from its directory and checked, not yet in a slot."""

    name: str
    path: str
    rank: int
    digest: str
    # module name -> (A [r, in], B^T * scale [r, out]), in the model's dtype
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def check_name(name: str) -> None:
    if not name or len(name) > MAX_NAME_CHARS or not (name.isascii() and name.isprintable()):
        raise InvalidArgument(
            f"lora name {name[:MAX_NAME_CHARS]!r}: give 1-{MAX_NAME_CHARS} printable ASCII "
            "characters")


def _read_config(directory: Path) -> tuple[dict[str, object], bytes]:
    if not directory.is_dir():
        raise NotFound(f"no adapter directory at {directory} on this executor")
    config_path = directory / CONFIG_FILE
    try:
        raw = config_path.read_bytes()
        config = json.loads(raw)
    except FileNotFoundError:
        raise InvalidArgument(f"{directory} has no {CONFIG_FILE}: not a PEFT adapter "
                              "directory") from None
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"{config_path} is unreadable: {exc}") from None
    if not isinstance(config, dict):
        raise InvalidArgument(f"{config_path} is not a JSON object")
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise InvalidArgument(f"{directory} holds a {kind} adapter; only LoRA is served")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise InvalidArgument(f"{directory}: {what} adapters are not supported; train a "
                                  "plain LoRA adapter")
    if config.get("bias", "none") != "none":
        raise InvalidArgument(f"{directory}: adapters that train biases are not supported")
    return config, raw


def _rank_and_scale(name: str, config: dict[str, object],
                    pairs: dict[str, dict[str, torch.Tensor]]) -> tuple[int, float]:
    """The config's rank, which every A matrix must have (per-module ranks are refused with
    rank_pattern), and PEFT's scaling: lora_alpha / r, or / sqrt(r) with rsLoRA."""
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not (isinstance(rank, int) and rank >= 1 and isinstance(alpha, int | float)
            and math.isfinite(alpha)):
        raise InvalidArgument(f"adapter {name!r}: adapter_config.json needs an integer r >= 1 "
                              f"and a number lora_alpha (got r={rank!r}, "
                              f"lora_alpha={alpha!r})")
    for module, pair in pairs.items():
        if "A" in pair and pair["A"].ndim != 2:
            raise InvalidArgument(f"adapter {name!r}: {module}'s lora_A is not a matrix")
        if "A" in pair and pair["A"].shape[0] != rank:
            raise InvalidArgument(f"adapter {name!r}: {module}'s lora_A has rank "
                                  f"{pair['A'].shape[0]}, not the config's r={rank}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scale)


def read_adapter(name: str, path: str, targets: dict[str, LoraLinear],
                 spec: LoraSpec) -> PeftAdapter:
    """Read and check a PEFT directory against this model; the errors say what is wrong."""
    check_name(name)
    directory = Path(path)
    config, raw_config = _read_config(directory)
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        bin_file = " (adapter_model.bin is pickle: save with safe_serialization)" if (
            directory / "adapter_model.bin").is_file() else ""
        raise InvalidArgument(f"{directory} has no {WEIGHTS_FILE}{bin_file}")
    try:
        raw_weights = weights_path.read_bytes()
        tensors = load(raw_weights)  # the bytes the digest is of
    except (SafetensorError, OSError) as exc:
        raise InvalidArgument(f"{weights_path} is unreadable: {exc}") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise InvalidArgument(f"{weights_path}: tensor {key!r} is not a LoRA A or B matrix "
                                  "of a linear layer (embeddings and extra modules are not "
                                  "supported)")
        pairs.setdefault(match["module"], {})[match["which"]] = tensor
    if not pairs:
        raise InvalidArgument(f"{weights_path} holds no LoRA weights")
    rank, scale = _rank_and_scale(name, config, pairs)
    if rank > spec.max_rank:
        raise InvalidArgument(f"adapter {name!r} has rank {rank}, over this executor's "
                              f"--max-lora-rank {spec.max_rank}")
    weights = {module: _checked_pair(name, module, pair, targets, scale)
               for module, pair in pairs.items()}
    digest = hashlib.sha256(raw_config + b"\x00" + raw_weights).hexdigest()
    base = config.get("base_model_name_or_path")
    log.info("lora_adapter_read", lora_name=name, path=str(directory), rank=rank,
             num_modules=len(weights), base_model=base, digest=digest[:16])
    return PeftAdapter(name, str(directory), rank, digest, weights)


def _checked_pair(name: str, module: str, pair: dict[str, torch.Tensor],
                  targets: dict[str, LoraLinear], scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    layer = targets.get(module)
    if layer is None:
        raise InvalidArgument(
            f"adapter {name!r} adapts {module}, which this model has no LoRA target at (it "
            f"adapts {', '.join(TARGET_MODULES)} of its decoder layers): an adapter of another "
            "base model?")
    if set(pair) != {"A", "B"}:
        raise InvalidArgument(f"adapter {name!r}: {module} lacks its lora_"
                              f"{'B' if 'A' in pair else 'A'} matrix")
    a, b = pair["A"], pair["B"]
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
        raise InvalidArgument(f"adapter {name!r}: {module}'s A {tuple(a.shape)} and B "
                              f"{tuple(b.shape)} are not a LoRA pair")
    if a.shape[1] != layer.in_features or b.shape[0] != layer.out_features:
        raise InvalidArgument(
            f"adapter {name!r} was trained for another base model: {module} maps "
            f"{a.shape[1]} -> {b.shape[0]} features in the adapter, {layer.in_features} -> "
            f"{layer.out_features} in this model")
    dtype: torch.dtype = layer.weight.dtype
    a, b = a.to(dtype), (b.float().t() * scale).to(dtype)
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        # Checked in the model's dtype: a float16 copy of a large weight is infinite.
        raise InvalidArgument(f"adapter {name!r}: {module} holds NaN or infinite weights (in "
                              f"{str(dtype).removeprefix('torch.')}, scaled)")
    return a, b


@dataclass(frozen=True, slots=True)
class Resident:
    adapter: PeftAdapter
    slot: int

    @property
    def info(self) -> LoraAdapterInfo:
        a = self.adapter
        return LoraAdapterInfo(name=a.name, digest=a.digest, rank=a.rank, path=a.path)


class Adapters:
    """The model's LoRA targets and the adapters resident in its slots. Changed only in the
    compute thread, between steps."""

    def __init__(self, model: torch.nn.Module, spec: LoraSpec) -> None:
        self.spec = spec
        self.batch = LoraBatch()
        self.targets = wrap_targets(model, spec, self.batch)
        self.slots: list[Resident | None] = [None] * spec.max_loras
        self.by_name: dict[str, Resident] = {}

    def read(self, name: str, path: str) -> PeftAdapter:
        """The slow part (file reads, checks): anywhere, before `install`."""
        return read_adapter(name, path, self.targets, self.spec)

    def install(self, adapter: PeftAdapter) -> LoraAdapterInfo:
        """Into the lowest free slot. The same name with the same contents again: nothing
        to do (several gateways may each load it)."""
        held = self.by_name.get(adapter.name)
        if held is not None:
            if held.adapter.digest == adapter.digest:
                return held.info
            raise AlreadyExists(f"an adapter named {adapter.name!r} is loaded with other "
                                "weights: unload it first, or choose another name")
        free = [i for i, r in enumerate(self.slots) if r is None]
        if not free:
            raise ResourceExhausted(
                f"all {self.spec.max_loras} adapter slots (--max-loras) are in use: unload "
                "one first")
        slot = free[0]
        self._clear(slot)  # modules the adapter leaves alone add nothing
        first = slot * self.spec.max_rank
        try:
            for module, (a, b) in adapter.weights.items():
                rows = slice(first, first + a.shape[0])  # the rows past its rank stay zero
                self.targets[module].lora_a[rows].copy_(a)
                self.targets[module].lora_b[rows].copy_(b)
        except BaseException:
            self._clear(slot)  # never half an adapter in a free slot
            raise
        resident = self.slots[slot] = self.by_name[adapter.name] = Resident(adapter, slot)
        log.info("lora_adapter_loaded", lora_name=adapter.name, slot=slot, rank=adapter.rank,
                 digest=adapter.digest[:16])
        return resident.info

    def remove(self, name: str, num_in_use: int) -> None:
        resident = self.by_name.get(name)
        if resident is None:
            raise NotFound(f"no adapter named {name!r} is loaded here")
        if num_in_use:
            raise FailedPrecondition(
                f"adapter {name!r} is in use by {num_in_use} request(s) held here: unload it "
                "once they finish")
        self._clear(resident.slot)
        self.slots[resident.slot] = None
        del self.by_name[name]
        log.info("lora_adapter_unloaded", lora_name=name, slot=resident.slot)

    def _clear(self, slot: int) -> None:
        rows = slice(slot * self.spec.max_rank, (slot + 1) * self.spec.max_rank)
        for layer in self.targets.values():
            layer.lora_a[rows].zero_()
            layer.lora_b[rows].zero_()

    def slot_of(self, name: str) -> int:
        """-1 for the base model (no name)."""
        return self.by_name[name].slot if name else -1

    def check(self, name: str, digest: str) -> None:
        """A new request's adapter is loaded here, with `digest` when the caller names one."""
        resident = self.by_name.get(name)
        if resident is None:
            raise NotFound(f"lora adapter {name!r} is not loaded on this executor "
                           f"(loaded: {', '.join(sorted(self.by_name)) or 'none'})")
        if digest and digest != resident.adapter.digest:
            raise FailedPrecondition(
                f"lora adapter {name!r} here has digest {resident.adapter.digest[:16]}..., "
                f"not the {digest[:16]}... the request was admitted for: it was replaced")

    def info(self) -> tuple[LoraAdapterInfo, ...]:
        return tuple(r.info for r in self.slots if r is not None)

    def arm(self, row_slots: list[int], device: torch.device) -> None:
        """Select each row's slot (-1: none) for the next forward."""
        highest = max(row_slots, default=-1)
        if highest < 0:
            self.batch.unselected = None
            return
        rank = self.spec.max_rank
        width = (highest + 1) * rank
        slots = torch.tensor(row_slots).to(device, non_blocking=True).unsqueeze(1)  # [T, 1]
        columns = torch.arange(width, device=device) // rank  # [width]
        self.batch.unselected = columns != slots
        self.batch.width = width

    def disarm(self) -> None:
        self.batch.unselected = None


def _decoder_linears(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, str]]:
    for parent_name, parent in model.named_modules():
        if ".layers." not in f".{parent_name}.":
            continue
        for child_name, child in parent.named_children():
            if child_name in TARGET_MODULES and hasattr(child, "in_features"):
                yield parent_name, parent, child_name


def wrap_targets(model: torch.nn.Module, spec: LoraSpec, batch: LoraBatch
                 ) -> dict[str, LoraLinear]:
    """Replace every target projection of the decoder layers by a LoraLinear around it;
    returns them by module name (PEFT's names, less its `base_model.model.` prefix)."""
    targets: dict[str, LoraLinear] = {}
    for parent_name, parent, child_name in list(_decoder_linears(model)):
        wrapped = LoraLinear(getattr(parent, child_name), spec, batch)
        setattr(parent, child_name, wrapped)
        targets[f"{parent_name}.{child_name}"] = wrapped
    return targets
