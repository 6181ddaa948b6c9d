"""What each model needs of an architecture, checked before any data loads or model is built: apart from the
models, which import torch, so that a search that only samples and checks configs (a light worker,
`headsearch.search.light`) never loads it. `vit` and `seq2seq` import them from here."""
from __future__ import annotations

from headsearch.config import ArchConfig
from headsearch.errors import ConfigError


def check_vit_arch(cfg: ArchConfig, image_size: int) -> None:
    """What the ViT needs of an architecture (tasks call it before any data loads)."""
    if cfg.dec_layers:
        raise ConfigError(f"arch.dec_layers = {cfg.dec_layers}: the ViT is encoder-only, set it to 0")
    if image_size % cfg.patch_size:
        fits = [p for p in range(1, image_size + 1) if image_size % p == 0]
        raise ConfigError(f"arch.patch_size = {cfg.patch_size} does not divide the {image_size}x{image_size}"
                          f" images: use one of {', '.join(map(str, fits))}")


def check_seq2seq_arch(cfg: ArchConfig) -> None:
    """What the encoder-decoder needs of an architecture (tasks call it before any data loads)."""
    if cfg.dec_layers < 1:
        raise ConfigError("arch.dec_layers = 0: the translation model needs a decoder, set dec_layers (and dec_heads), e.g. 6 and 8")
