"""Configuration: one frozen dataclass per concern, validated on construction, round-tripping through YAML.

`ArchConfig` is the architecture (what the search varies), `TrainConfig` the optimisation, and
`RunConfig` ties them to a task, a seed and the task's data options. A run directory stores the
resolved `RunConfig` as `config.yaml`; `headsearch train --config` accepts that file as is, or a file
holding only architecture fields.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

import yaml

from headsearch.errors import ConfigError

SKIPS = ("none", "output", "scores", "value", "unet", "dense")
FUSIONS = ("none", "hadamard", "add", "differential")
SOFT_SCORES = ("pairwise", "key")
ACTIVATIONS = ("gelu", "relu")
OPTIMIZERS = ("adamw", "adam")
LR_SCHEDULES = ("constant", "cosine")
AMP_MODES = ("auto", "bf16", "off")
# How training steps run (headsearch/training/fastpath.py): "auto" is the fastest the device allows
# (CUDA: compiled blocks + the whole step in a CUDA graph; CPU: eager); "off" eager; "graphs" eager in a
# CUDA graph; "default" compiled blocks; "reduce-overhead"/"max-autotune" compiled blocks in a CUDA graph.
COMPILE_MODES = ("auto", "off", "graphs", "default", "reduce-overhead", "max-autotune")
CHANNELS_LAST = ("auto", "on", "off")


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name} = {value!r} is not known: use one of {', '.join(allowed)}")


def coerce_fields(obj: Any, ints: tuple[str, ...] = (), floats: tuple[str, ...] = (), bools: tuple[str, ...] = (),
            optional: tuple[str, ...] = ()) -> None:
    """Coerce fields of a frozen dataclass to their types, or raise a ConfigError naming the field."""
    for name in ints + floats + bools:
        value = getattr(obj, name)
        if value is None and name in optional:
            continue
        try:
            if isinstance(value, bool) != (name in bools):  # true/false for a bool field only, never for a number
                raise ValueError
            if name in bools:
                continue
            if name in ints:
                as_float = float(value)
                if not as_float.is_integer():
                    raise ValueError
                object.__setattr__(obj, name, int(as_float))
            else:
                object.__setattr__(obj, name, float(value))
        except (TypeError, ValueError):
            kind = "an integer" if name in ints else "a number" if name in floats else "true or false"
            raise ConfigError(f"{name} = {value!r} must be {kind}") from None


def whole_number(value: Any) -> int | None:
    """`value` as an int when it is a whole number (an int, or a float such as 4.0), else None
    (booleans, infinities, NaN, fractions, strings, lists)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():  # False for inf and nan
        return int(value)
    return None


def _heads_tuple(name: str, heads: Any, layers: int) -> tuple[int, ...]:
    """Accept an int (uniform), a list, or a comma string ("64,32,16") and return a tuple of ints."""
    if isinstance(heads, str):
        try:
            heads = [int(h) for h in heads.replace(" ", "").split(",") if h]
        except ValueError:
            raise ConfigError(f"{name} = {heads!r} is not a list of head counts: write e.g. 64,32,16,8") from None
    if (n := whole_number(heads)) is not None:
        if n < 1:
            raise ConfigError(f"{name} = {n}: every layer needs at least one head")
        return (n,) * layers
    if not isinstance(heads, (list, tuple)):
        raise ConfigError(f"{name} = {heads!r} is not a list of head counts: write e.g. [64, 32, 16, 8]")
    out = tuple(whole_number(h) for h in heads)
    if None in out:
        raise ConfigError(f"{name} = {list(heads)} must hold whole numbers of heads, e.g. [64, 32, 16, 8]")
    return out


class ConfigSection:
    """The dict/YAML side of a frozen config dataclass (a mixin, no state of its own): its fields, tuples as lists."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v) for f in fields(self)}


@dataclass(frozen=True)
class ArchConfig(ConfigSection):
    """A transformer architecture with per-layer head counts.

    Defaults are the CIFAR-10 ViT of Martínez-Marín et al. (HAM; docs/design.md §4.1): embed 48, 4 layers x 4
    heads, MLP 192, GELU, no dropout.
    `enc_heads`/`dec_heads` take one head count per layer; an int means the same count everywhere.
    `head_dim="split"` gives each head d_model / h dimensions (Deep Head, Cruz et al., eq. 1; docs/design.md §1), so the projection
    weights have the same shape whatever the schedule; an int fixes the head width instead and the
    attention width becomes h * head_dim (as timm allows).
    `skip` connects successive attention layers of a stack (docs/design.md §2): "output" adds and
    normalises the merged head outputs (Deep Head), "scores" adds the pre-softmax scores (RealFormer,
    He et al. 2020), "value" mixes each layer's values with the first layer's (ResFormer, Zhou et al. 2024);
    or the stack's blocks across the residual stream: "unet" adds block i's output to block L-1-i's input,
    "dense" averages every earlier block's output (DenseFormer, Pagliardini et al. 2024).
    `skip_mean` makes the scores skip a running mean instead of a running sum.
    `fusion` fuses each head's self-attention with a soft (additive, Bahdanau) attention branch:
    "hadamard" is HAM A, "add" is HAM B (Martínez-Marín et al.; docs/design.md §3); "differential" makes each
    head the difference of two softmax maps (DIFF Transformer, Ye et al. 2024). `soft_dim` is the soft branch's width d_a
    (None = d_k); `soft_score="key"` scores keys alone (cheaper) instead of query-key pairs.
    """

    d_model: int = 48
    enc_layers: int = 4
    enc_heads: tuple[int, ...] = 4
    dec_layers: int = 0
    dec_heads: tuple[int, ...] = 8
    d_ff: int = 192
    head_dim: int | str = "split"
    skip: str = "none"
    skip_mean: bool = False
    fusion: str = "none"
    soft_dim: int | None = None
    soft_score: str = "pairwise"
    activation: str = "gelu"
    dropout: float = 0.0
    attn_dropout: float = 0.0
    patch_size: int = 4  # ViT only: 32x32 images in 4x4 patches give 64 tokens (+ CLS)

    def __post_init__(self) -> None:
        # Frozen, so normalise through object.__setattr__ (the litgpt idiom).
        coerce_fields(self, ints=("d_model", "enc_layers", "dec_layers", "d_ff", "patch_size", "soft_dim"),
                floats=("dropout", "attn_dropout"), bools=("skip_mean",), optional=("soft_dim",))
        for name in ("skip", "fusion", "soft_score", "activation"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"{name} = {getattr(self, name)!r} must be a name")
        if self.head_dim != "split":
            if (width := whole_number(self.head_dim)) is None:
                raise ConfigError(f"head_dim = {self.head_dim!r} must be 'split' (d_model / heads) or a positive integer")
            object.__setattr__(self, "head_dim", width)
        object.__setattr__(self, "enc_heads", _heads_tuple("enc_heads", self.enc_heads, self.enc_layers))
        object.__setattr__(self, "dec_heads", _heads_tuple("dec_heads", self.dec_heads, self.dec_layers))
        self._validate()

    # -- validation -------------------------------------------------------------------------
    def _validate(self) -> None:
        for name in ("d_model", "enc_layers", "d_ff", "patch_size"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"{name} = {getattr(self, name)} must be a positive integer")
        if self.dec_layers < 0:
            raise ConfigError(f"dec_layers = {self.dec_layers} must be 0 (encoder only) or more")
        for name, allowed in (("skip", SKIPS), ("fusion", FUSIONS), ("soft_score", SOFT_SCORES),
                              ("activation", ACTIVATIONS)):
            _choice(name, getattr(self, name), allowed)
        for name in ("dropout", "attn_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{name} = {getattr(self, name)} must be in [0, 1)")
        if self.head_dim != "split" and (not isinstance(self.head_dim, int) or self.head_dim < 1):
            raise ConfigError(f"head_dim = {self.head_dim!r} must be 'split' (d_model / heads) or a positive integer")
        if self.soft_dim is not None and self.soft_dim < 1:
            raise ConfigError(f"soft_dim = {self.soft_dim} must be a positive integer or null (= head width)")
        self._validate_stack("enc_heads", self.enc_heads, self.enc_layers, "enc_layers")
        self._validate_stack("dec_heads", self.dec_heads, self.dec_layers, "dec_layers")

    def _validate_stack(self, name: str, heads: tuple[int, ...], layers: int, layers_name: str) -> None:
        if len(heads) != layers:
            raise ConfigError(
                f"{name} lists {len(heads)} head counts but {layers_name} is {layers}: give one count per layer"
                f" (or a single number for the same count in every layer)"
            )
        for i, h in enumerate(heads):
            if h < 1:
                raise ConfigError(f"{name}[{i}] = {h}: every layer needs at least one head")
            if self.head_dim == "split" and self.d_model % h:
                raise ConfigError(
                    f"{name}[{i}] = {h} does not divide d_model = {self.d_model}: with head_dim 'split' each head"
                    f" gets d_model / h dimensions, so use a divisor of {self.d_model} or set head_dim to a fixed width"
                )
            if self.fusion == "differential" and self.head_width(h) % 2:
                raise ConfigError(
                    f"fusion 'differential' splits each head's queries and keys in two halves, but {name}[{i}] = {h}"
                    f" gives heads of odd width {self.head_width(h)}: use fewer heads or another fusion"
                )
        for i in range(1, len(heads)):
            a, b = heads[i - 1], heads[i]
            if self.skip == "scores" and max(a, b) % min(a, b):
                raise ConfigError(
                    f"skip 'scores' maps scores from {a} to {b} heads ({name}[{i - 1}] -> {name}[{i}]) by averaging or"
                    f" repeating head groups, so one count must divide the other: change the schedule or the skip"
                )
            if self.skip in ("output", "value") and self.attn_dim(a) != self.attn_dim(b):
                what = ("adds merged head outputs of successive layers" if self.skip == "output"
                        else "mixes the first layer's values into every later layer's")
                raise ConfigError(
                    f"skip {self.skip!r} {what}, but a fixed head_dim = {self.head_dim}"
                    f" gives widths {self.attn_dim(a)} and {self.attn_dim(b)} ({name}[{i - 1}], {name}[{i}]):"
                    f" use head_dim 'split' or equal head counts"
                )

    # -- derived ----------------------------------------------------------------------------
    def head_width(self, heads: int) -> int:
        """d_k for a layer with `heads` heads."""
        return self.d_model // heads if self.head_dim == "split" else int(self.head_dim)

    def attn_dim(self, heads: int) -> int:
        """Width of the concatenated heads (the input of W_o)."""
        return heads * self.head_width(heads)

    # -- dict / YAML ------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any], base: "ArchConfig | None" = None) -> "ArchConfig":
        """Build from a mapping, over `base`'s values for the keys it leaves out.

        A per-layer head list without a layer count sets the count; a layer count without heads
        keeps a uniform base schedule uniform (a non-uniform one must then be given again).
        """
        _reject_unknown("arch", d, cls)
        given = dict(d)
        for heads, layers in (("enc_heads", "enc_layers"), ("dec_heads", "dec_layers")):
            per_layer = heads in given and not isinstance(given[heads], int)
            if per_layer and layers not in given:
                given[layers] = len(_heads_tuple(heads, given[heads], 1))
            if layers in given and heads not in given and base is not None:
                base_heads = getattr(base, heads)
                if len(set(base_heads)) <= 1:
                    given[heads] = base_heads[0] if base_heads else cls.__dataclass_fields__[heads].default
        return merge_from_dict(cls, "arch", given, base)


def _reject_unknown(section: str, d: Mapping[str, Any], cls: type) -> None:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ConfigError(f"unknown {section} key(s) {', '.join(unknown)}: known keys are {', '.join(sorted(known))}")


def _compile_mode(value: Any) -> Any:
    """Configs written before compile took a mode said true or false: read them as "default" and "off"."""
    if value is None or value is False:
        return "off"
    if value is True:
        return "default"
    return value  # a name, checked against COMPILE_MODES with the other choices


@dataclass(frozen=True)
class TrainConfig(ConfigSection):
    """Optimisation settings. Each task supplies the defaults of the paper it reproduces (docs/design.md §4)."""

    epochs: int = 10
    batch_size: int = 256
    optimizer: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_epochs: float = 0.0
    schedule: str = "constant"
    min_lr_ratio: float = 0.0  # cosine decays to lr * min_lr_ratio
    label_smoothing: float = 0.0
    grad_clip: float | None = None
    amp: str = "auto"  # "auto": bf16 autocast on CUDA, fp32 on CPU
    target: float | None = None  # validation metric value whose first reach is timed ("seconds to target")
    max_steps_per_epoch: int | None = None  # cut epochs short (smoke tests, quick benchmarks)
    compile: str = "auto"  # step mode (COMPILE_MODES); true/false in old configs mean default/off
    channels_last: str = "auto"  # image tasks: NHWC activations and weights; "auto": on for CUDA, off on CPU
    # After each epoch, measure the head-diversity layer scalars (the X-Raying article tracks them over
    # training) on this many validation samples; 0 = off.
    diversity_samples: int = 0

    def __post_init__(self) -> None:
        coerce_fields(self, ints=("epochs", "batch_size", "max_steps_per_epoch", "diversity_samples"),
                floats=("lr", "weight_decay", "eps", "warmup_epochs", "min_lr_ratio", "label_smoothing", "grad_clip", "target"),
                optional=("grad_clip", "target", "max_steps_per_epoch"))
        object.__setattr__(self, "compile", _compile_mode(self.compile))
        betas = self.betas
        if (not isinstance(betas, (list, tuple)) or len(betas) != 2
                or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in betas)):
            raise ConfigError(f"betas = {betas!r} must be two numbers, e.g. [0.9, 0.999]")
        object.__setattr__(self, "betas", tuple(float(b) for b in betas))
        for name in ("optimizer", "schedule", "amp", "channels_last"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"{name} = {getattr(self, name)!r} must be a name")
        for name in ("epochs", "batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} = {getattr(self, name)} must be at least 1")
        for name in ("lr", "weight_decay", "eps", "warmup_epochs", "min_lr_ratio", "label_smoothing", "grad_clip", "target"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ConfigError(f"{name} = {value} must be a finite number")
        if not self.lr > 0:
            raise ConfigError(f"lr = {self.lr} must be positive")
        for name in ("weight_decay", "warmup_epochs"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} = {getattr(self, name)} must not be negative")
        if not self.eps > 0:
            raise ConfigError(f"eps = {self.eps} must be positive (Adam divides by sqrt(v) + eps), e.g. 1e-8")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"min_lr_ratio = {self.min_lr_ratio} must be in [0, 1]: the cosine schedule ends at lr * min_lr_ratio")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"label_smoothing = {self.label_smoothing} must be in [0, 1)")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ConfigError(f"grad_clip = {self.grad_clip} must be positive, or null for no clipping")
        if self.diversity_samples < 0:
            raise ConfigError(f"diversity_samples = {self.diversity_samples} must be 0 (off) or a number of samples")
        if self.max_steps_per_epoch is not None and self.max_steps_per_epoch < 1:
            raise ConfigError(f"max_steps_per_epoch = {self.max_steps_per_epoch} must be at least 1, or null")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"betas = {list(self.betas)} must both be in [0, 1), e.g. [0.9, 0.999]")
        for name, allowed in (("optimizer", OPTIMIZERS), ("schedule", LR_SCHEDULES), ("amp", AMP_MODES),
                              ("compile", COMPILE_MODES), ("channels_last", CHANNELS_LAST)):
            _choice(name, getattr(self, name), allowed)

    def uses_channels_last(self, device_type: str) -> bool:
        """Whether image tasks run channels-last on this device ("auto": only CUDA's kernels gain from it)."""
        return self.channels_last == "on" or (self.channels_last == "auto" and device_type == "cuda")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], base: "TrainConfig | None" = None) -> "TrainConfig":
        return merge_from_dict(cls, "train", d, base)


def merge_from_dict(cls: type, section: str, d: Mapping[str, Any], base: Any = None) -> Any:
    """`cls(**(base's fields updated by d))`, rejecting keys `cls` does not have: the `from_dict` of
    every frozen config section (a task's data options too)."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"config section {section!r} must be a mapping of keys to values")
    _reject_unknown(section, d, cls)
    merged = base.to_dict() if base is not None else {}
    merged.update(d)
    return cls(**merged)


class DataOptions(ConfigSection):
    """The dict/YAML side of a task's frozen data-options dataclass (a mixin, no state of its own)."""

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], base: Any = None) -> Any:
        return merge_from_dict(cls, "data", d, base)


@dataclass(frozen=True)
class RunConfig:
    """Everything that determines a training run: task, seed, architecture, training and data options.

    `data` is the task's data-options dataclass (`Task.data_options`); a plain mapping is kept as is
    for code that builds a config without a task.
    """

    task: str
    arch: ArchConfig = field(default_factory=ArchConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: Any = field(default_factory=dict)
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.task, str) or not self.task:
            raise ConfigError(f"task = {self.task!r} must be a task name (see `headsearch tasks`)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"seed = {self.seed!r} must be a non-negative integer")
        for name, cls in (("arch", ArchConfig), ("train", TrainConfig)):
            value = getattr(self, name)
            if isinstance(value, Mapping):
                object.__setattr__(self, name, cls.from_dict(value))
            elif not isinstance(value, cls):
                raise ConfigError(f"{name} = {value!r} must be a mapping of {name} fields")
        if isinstance(self.data, Mapping):
            object.__setattr__(self, "data", dict(self.data))
        elif not hasattr(self.data, "to_dict"):
            raise ConfigError(f"data = {self.data!r} must be a mapping of data options")

    def to_dict(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "seed": self.seed,
            "arch": self.arch.to_dict(),
            "train": self.train.to_dict(),
            "data": dict(self.data) if isinstance(self.data, Mapping) else self.data.to_dict(),
        }

    def replace(self, **changes: Any) -> "RunConfig":
        return dataclasses.replace(self, **changes)

    def key(self, *sections: str) -> str:
        """One string for the config (or only its `sections`, e.g. "data", "seed"): equal keys, equal configs.
        The key of the whole config equals `stable_key` of its dict, as a trial stores it."""
        d = self.to_dict()
        return stable_key([d[s] for s in sections] if sections else d)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def stable_key(value: Any) -> str:
    """`value` (a config's dict, or anything made of JSON's types) as one canonical string: the one recipe
    behind every key of a config (a trial's architecture, a worker's data, a cohort, a fair-clock speed)."""
    return json.dumps(value, sort_keys=True, default=str)


class _Loader(yaml.SafeLoader):
    """PyYAML follows YAML 1.1, which reads `1e-3` (no dot) as a string; YAML 1.2 and users read a number."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


def path_problem(path: Path, kind: str = "file") -> str | None:
    """What stops `path` being used as a `kind` ("file" or "folder") to read: "does not exist", "is a
    folder, not a file", "is a file, not a folder", "is not readable (permission denied)"; None if nothing.
    The one wording every path argument's error uses."""
    path = Path(path)
    if not path.exists():
        return "does not exist"
    if kind == "file" and path.is_dir():
        return "is a folder, not a file"
    if kind == "folder" and not path.is_dir():
        return "is a file, not a folder"
    if not os.access(path, os.R_OK | (os.X_OK if kind == "folder" else 0)):
        return "is not readable (permission denied)"
    return None


def read_text_file(path: Path, what: str, hint: str) -> str:
    """A UTF-8 text file's content, or one ConfigError naming the path and what is wrong with it."""
    path = Path(path)
    if (problem := path_problem(path, "file")) is not None:
        raise ConfigError(f"{what} {path} {problem}: {hint}")
    try:
        return path.read_text(encoding="utf-8")
    except PermissionError:
        raise ConfigError(f"{what} {path} is not readable (permission denied): fix its permissions or copy it") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {path} is not UTF-8 text (a binary file?): {hint}") from None
    except OSError as e:
        raise ConfigError(f"{what} {path} cannot be read ({e.strerror}): {hint}") from None


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping, with one-line errors for a missing or malformed file."""
    path = Path(path)
    text = read_text_file(path, "config file", "pass the path of a YAML file")
    try:
        d = parse_yaml(text)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" (line {where.line + 1})" if where is not None else ""
        raise ConfigError(f"config file {path} is not valid YAML{at}: fix the syntax") from None
    if not isinstance(d, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys to values")
    return d


RUN_CONFIG_SECTIONS = ("task", "seed", "arch", "train", "data")


def is_run_config(d: Mapping[str, Any]) -> bool:
    """A run config (as written into run directories and by `export`) has any of the sections task, seed,
    arch, train, data (it may give only some of them); otherwise the file holds architecture fields alone."""
    return any(key in d for key in RUN_CONFIG_SECTIONS)
