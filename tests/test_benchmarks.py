"""The benchmarks' references compute what headsearch's models compute, and the result files are complete."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from headsearch.config import ArchConfig
from headsearch.models import Seq2Seq, ViT

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import common  # noqa: E402
from references import ReferenceSeq2Seq, ReferenceViT  # noqa: E402


def n_params(m) -> int:
    return sum(p.numel() for p in m.parameters())


def copy_block(ours, ref, prefix_attn="attn") -> None:
    """Our pre-LN encoder block's weights into an nn.TransformerEncoderLayer."""
    attn = getattr(ours, prefix_attn)
    ref.self_attn.in_proj_weight.data.copy_(attn.qkv_proj.weight)
    ref.self_attn.in_proj_bias.data.copy_(attn.qkv_proj.bias)
    ref.self_attn.out_proj.load_state_dict(attn.out_proj.state_dict())
    ref.norm1.load_state_dict(ours.norm1.state_dict())
    ref.norm2.load_state_dict(ours.norm2.state_dict())
    ref.linear1.load_state_dict(ours.mlp.fc1.state_dict())
    ref.linear2.load_state_dict(ours.mlp.fc2.state_dict())


@pytest.mark.parametrize("heads", [4, (16, 8, 4, 2)])
def test_reference_vit_is_the_same_function(heads):
    cfg = ArchConfig(d_model=32 if heads != 4 else 48, enc_heads=heads, d_ff=64)
    ours, ref = ViT(cfg).eval(), ReferenceViT(cfg).eval()
    assert n_params(ours) == n_params(ref)
    for name in ("patch_embed", "head"):
        getattr(ref, name).load_state_dict(getattr(ours, name).state_dict())
    ref.cls_token.data.copy_(ours.cls_token)
    ref.pos_embed.data.copy_(ours.pos_embed)
    ref.norm.load_state_dict(ours.encoder.norm.state_dict())
    for block, layer in zip(ours.encoder.blocks, ref.layers):
        copy_block(block, layer)
    x = torch.randn(3, 3, 32, 32)
    # Training mode: nn.TransformerEncoderLayer's inference fast path is not what the benchmark times.
    ours.train(), ref.train()
    torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-4)


def test_reference_seq2seq_is_the_same_function():
    cfg = ArchConfig(d_model=32, enc_layers=2, enc_heads=4, dec_layers=2, dec_heads=4, d_ff=64, activation="relu")
    ours, ref = Seq2Seq(cfg, 50, 60, 20, pad_id=0), ReferenceSeq2Seq(cfg, 50, 60, 20, pad_id=0)
    assert n_params(ours) == n_params(ref)
    for name in ("src_embed", "tgt_embed", "generator"):
        getattr(ref, name).load_state_dict(getattr(ours, name).state_dict())
    t = ref.transformer
    t.encoder.norm.load_state_dict(ours.encoder.norm.state_dict())
    t.decoder.norm.load_state_dict(ours.decoder.norm.state_dict())
    for block, layer in zip(ours.encoder.blocks, t.encoder.layers):
        copy_block(block, layer)
    d = cfg.d_model
    for block, layer in zip(ours.decoder.blocks, t.decoder.layers):
        copy_block(block, layer, "self_attn")
        cross = block.cross_attn
        layer.multihead_attn.in_proj_weight.data.copy_(torch.cat([cross.q_proj.weight, cross.kv_proj.weight]))
        layer.multihead_attn.in_proj_bias.data.copy_(torch.cat([cross.q_proj.bias, cross.kv_proj.bias]))
        layer.multihead_attn.out_proj.load_state_dict(cross.out_proj.state_dict())
        layer.norm3.load_state_dict(block.norm3.state_dict())
        layer.norm2.load_state_dict(block.norm2.state_dict())
    assert layer.multihead_attn.in_proj_weight.shape == (3 * d, d)
    src = torch.tensor([[5, 6, 7, 2, 0, 0], [8, 9, 10, 11, 12, 2]])  # 0 = PAD
    tgt = torch.tensor([[1, 13, 14, 0], [1, 15, 16, 17]])
    ours.train(), ref.train()  # dropout is 0: training mode only selects the slow, general paths
    out_ours, out_ref = ours(src, tgt), ref(src, tgt)
    real = tgt != 0  # padded query positions differ by convention (masked rows) and are never scored
    torch.testing.assert_close(out_ours[real], out_ref[real], atol=1e-5, rtol=1e-4)


def test_alternate_rotates_and_measures_every_round():
    calls = []
    cases = {"a": lambda: calls.append("a") or 10, "b": lambda: calls.append("b") or 20}
    rates = common.alternate(cases, repeats=3, device=torch.device("cpu"), warmup=1)
    assert [len(v) for v in rates.values()] == [3, 3]
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]  # the first runner alternates
    assert all(r > 0 for r in rates["a"] + rates["b"])


@pytest.mark.processes
def test_table_and_report_write_a_complete_section(tmp_path, monkeypatch):
    table = common.markdown_table(["model", "samples/s", "ratio"], [["ViT", 812.345, "1.000"], ["ref", 7.5, "0.9"]])
    assert table.splitlines()[2].split("|")[2].strip() == "812"
    assert table.splitlines()[3].split("|")[2].strip() == "7.5"
    monkeypatch.setattr(sys, "argv", [str(BENCH / "demo.py"), "--quick", "--results", str(tmp_path / "R.md")])
    args = common.parser("x").parse_args()
    common.report("Demo", table, torch.device("cpu"), args, ["a note"])
    text = (tmp_path / "R.md").read_text()
    assert "## Demo (quick, " in text and "- command: `python benchmarks/demo.py --quick" in text
    assert "- device: CPU: " in text and "torch " + torch.__version__ in text and "headsearch " in text
    assert table in text and "- a note" in text


@pytest.mark.processes
def test_the_quick_gpu_check_fits_eight_minutes_and_its_files_are_there(tmp_path):
    """`bash benchmarks/gpu.sh --dry-run quick` prints the 8-minute check's commands (a lent GPU machine has 15
    minutes in all, its start included): each step with its cap, the whole under one 440-s deadline. Every file
    the steps name exists, and a step whose run left nothing says so in one line."""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(["bash", "benchmarks/gpu.sh", "--dry-run", "quick"], cwd=root, capture_output=True, text=True,
                         timeout=60, env={**os.environ, "HEADSEARCH_DATA": "/data"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    steps = [line.split(",")[0].removeprefix("+ [") for line in lines if line.startswith("+ [")]
    assert steps == ["S1-vit-auto", "S1-vit-off", "S2-pytest", "S2-probe", "S3-run", "S4-bench", "S5-translation"]
    assert lines[-1].startswith("at most 440 s in all") and 440 <= 8 * 60
    for name in ("vit.yaml", "space.yaml", "probe.py", "summary.py"):
        assert (root / "benchmarks" / "gpu_quick" / name).is_file()
    assert "--ks 8 --modes reduce-overhead --no-cohorts" in out.stdout  # the bench narrowed to fit
    missing = subprocess.run([sys.executable, "benchmarks/gpu_quick/summary.py", "translation", str(tmp_path)], cwd=root,
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 0 and missing.stdout.startswith("translation: NO RESULT")
    bad = subprocess.run(["bash", "benchmarks/gpu.sh", "nope"], cwd=root, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "usage:" in bad.stderr
