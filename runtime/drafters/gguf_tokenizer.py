"""A target's tokenizer as GGUF metadata: what llama.cpp's converter writes into an EAGLE-3 head.

llama-server checks that a draft model's vocabulary matches its target's (type, BOS handling,
token texts), so an EAGLE-3 head GGUF carries the target's tokenizer. From a GGUF target its
`tokenizer.*` keys are copied as they are. From a Hugging Face target this writes what
`convert_hf_to_gguf.py` writes for a Llama-family tokenizer (`LlamaModel.set_vocab`), ported so
that no llama.cpp checkout is needed: SentencePiece (tokenizer.model), a byte-fallback BPE
(tokenizer.json), or a GPT-2 BPE whose pre-tokenizer the converter recognises.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from hashlib import sha256
from pathlib import Path
from typing import Any

import gguf

from runtime.errors import ModelLoadError
from runtime.loader import PACKAGED, _packaged_file


@dataclass
class GGUFKey:
    """One metadata key of a GGUF file, with its value types."""

    name: str
    value: Any
    type: gguf.GGUFValueType
    sub_type: gguf.GGUFValueType | None = None  # the element type of an ARRAY


@dataclass
class GGUFTarget:
    """What an EAGLE-3 head GGUF needs from its target."""

    path: Path  # a .gguf file or a Hugging Face model directory
    is_gguf: bool
    hidden_size: int
    num_layers: int
    vocab_size: int
    tokenizer_keys: list[GGUFKey] = field(default_factory=list)  # a GGUF target's tokenizer.* keys


def resolve_target(spec: str) -> GGUFTarget:
    """`spec` (a packaged name such as smollm2-135m, a .gguf file, or a Hugging Face directory)
    as the runtime resolves targets, without converting a GGUF. Raises ModelLoadError."""
    if spec in PACKAGED:
        return _gguf_target(_packaged_file(spec))
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_target(path)
    if path.is_dir() and (path / "config.json").is_file():
        return _hf_target(path)
    raise ModelLoadError(f"target {spec!r} not found: give a Hugging Face model directory, a .gguf file, "
                         f"or one of: {', '.join(PACKAGED)}")


def _gguf_target(path: Path) -> GGUFTarget:
    """The GGUF target's metadata, read once per file version: parsing a target's tokenizer (49k
    tokens and merges for SmolLM2) costs seconds, and the trainer exports a GGUF head every round.
    The returned object is shared: read it, never change it."""
    try:
        st = path.stat()
    except OSError as e:
        raise ModelLoadError(f"cannot read GGUF {path}: {e}") from e
    return _read_gguf_target(path.resolve(), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _read_gguf_target(path: Path, size: int, mtime_ns: int) -> GGUFTarget:
    """`size` and `mtime_ns` only key the cache: a file replaced in place is read again."""
    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read GGUF {path}: {e}") from e
    arch = _scalar(reader, "general.architecture")
    tokens = reader.get_field("tokenizer.ggml.tokens")
    if arch is None or tokens is None:
        raise ModelLoadError(f"{path} has no architecture or no tokenizer: not a model GGUF")
    vocab = _scalar(reader, f"{arch}.vocab_size")
    keys = [GGUFKey(f.name, _raw_value(f), f.types[0], f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
            for f in reader.fields.values() if f.name.startswith("tokenizer.")]
    return GGUFTarget(path, True, int(_scalar(reader, f"{arch}.embedding_length")),
                      int(_scalar(reader, f"{arch}.block_count")),
                      int(vocab if vocab is not None else len(tokens.data)), keys)


def _hf_target(path: Path) -> GGUFTarget:
    cfg = json.loads((path / "config.json").read_text())
    cfg = {**cfg, **cfg.get("text_config", {})}  # as the converter reads multimodal configs
    try:
        return GGUFTarget(path, False, int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), int(cfg["vocab_size"]))
    except KeyError as e:
        raise ModelLoadError(f"{path}/config.json has no {e.args[0]}: not a causal LM config") from None


def _scalar(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    return None if field is None else field.contents()


# -- writing ----------------------------------------------------------------------------------


def add_tokenizer(writer: gguf.GGUFWriter, target: GGUFTarget, vocab_size: int) -> None:
    """Adds the target's tokenizer keys; `vocab_size` is the head's (its config's vocab_size),
    which the converter's Llama special cases read. Raises ModelLoadError."""
    if target.is_gguf:  # copied as they are: llama-server compares them with the target's
        for key in target.tokenizer_keys:
            writer.add_key_value(key.name, key.value, key.type, sub_type=key.sub_type)
    else:
        _add_hf_tokenizer(writer, target.path, vocab_size)


def _raw_value(f: gguf.ReaderField) -> Any:
    """The field's value; strings as raw bytes (a token need not be valid UTF-8)."""
    strings = f.types[-1] == gguf.GGUFValueType.STRING
    if f.types[0] == gguf.GGUFValueType.ARRAY:
        return [bytes(f.parts[i]) for i in f.data] if strings else [f.parts[i][0].item() for i in f.data]
    return bytes(f.parts[f.data[0]]) if strings else f.parts[f.data[0]][0].item()


def _add_hf_tokenizer(writer: gguf.GGUFWriter, path: Path, vocab_size: int) -> None:
    """LlamaModel.set_vocab of convert_hf_to_gguf.py: SentencePiece, else llama-hf, else GPT-2."""
    if not any((path / f).is_file() for f in ("tokenizer.model", "tokenizer.json", "vocab.json")):
        raise ModelLoadError(f"target {path} has no tokenizer (tokenizer.model, tokenizer.json or vocab.json): "
                             "give --target as the target's GGUF file or a directory with its tokenizer")
    config = _json(path / "tokenizer_config.json")
    if (prefix := config.get("add_prefix_space")) is not None:
        writer.add_add_space_prefix(prefix)
    if (path / "tokenizer.model").is_file():
        tokens, scores, types = _sentencepiece_vocab(path, vocab_size)
        _add_llama_vocab(writer, tokens, scores, types)
        SpecialVocab(path, n_vocab=len(tokens)).add_to_gguf(writer)
    elif (llama_hf := _llama_hf_vocab(path)) is not None:
        tokens, scores, types = llama_hf
        _add_llama_vocab(writer, tokens, scores, types)
        SpecialVocab(path, n_vocab=len(tokens)).add_to_gguf(writer)
    else:
        tokens, types, pre = _gpt2_vocab(path, vocab_size)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        SpecialVocab(path, load_merges=True).add_to_gguf(writer)
    if vocab_size == 32016:  # CodeLlama's infill tokens, as the converter marks them
        for typ, tid in (("prefix", 32007), ("suffix", 32008), ("middle", 32009), ("eot", 32010)):
            getattr(writer, f"add_{typ}_token_id")(tid)
    if vocab_size == 49152:  # the converter's rule for Granite-small/SmolLM-sized Llama vocabularies
        writer.kv_data[0].pop("tokenizer.ggml.add_bos_token", None)  # overwritten, as there, without a warning
        writer.add_add_bos_token(False)


def _add_llama_vocab(writer: gguf.GGUFWriter, tokens: list[bytes], scores: list[float], types: list[int]) -> None:
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _sentencepiece_vocab(path: Path, vocab_size: int) -> tuple[list[bytes], list[float], list[int]]:
    """_create_vocab_sentencepiece, read from the model's protobuf (no sentencepiece package needed)."""
    from transformers.convert_slow_tokenizer import import_protobuf

    proto = import_protobuf().ModelProto()
    proto.ParseFromString((path / "tokenizer.model").read_bytes())
    t = gguf.TokenType
    # SentencePiece piece types -> llama.cpp token types (a user-defined piece stays NORMAL there)
    kinds = {2: t.UNKNOWN, 3: t.CONTROL, 5: t.UNUSED, 6: t.BYTE}
    tokens = [f"[PAD{i}]".encode() for i in range(vocab_size)]
    scores, types = [-10000.0] * vocab_size, [int(t.UNUSED)] * vocab_size
    for i, piece in enumerate(proto.pieces[:vocab_size]):
        tokens[i], scores[i], types[i] = piece.piece.encode("utf-8"), piece.score, int(kinds.get(piece.type, t.NORMAL))
    for text, i in _json(path / "added_tokens.json").items():
        if i < vocab_size:
            tokens[i], scores[i], types[i] = text.encode("utf-8"), -1000.0, int(t.USER_DEFINED)
    for key, data in _json(path / "tokenizer_config.json").get("added_tokens_decoder", {}).items():
        i, text = int(key), data["content"]
        if i >= vocab_size:
            continue
        if data.get("special") or looks_special(text):
            types[i] = int(t.CONTROL)
        else:
            text, types[i] = text.replace("\u2581", " "), int(t.USER_DEFINED)
        scores[i], tokens[i] = -1000.0, text.encode("utf-8")
    return tokens, scores, types


def _llama_hf_vocab(path: Path) -> tuple[list[bytes], list[float], list[int]] | None:
    """_set_vocab_llama_hf (gguf's LlamaHfVocab), or None where the converter falls back to GPT-2."""
    try:
        vocab = gguf.LlamaHfVocab(path)
    except (FileNotFoundError, TypeError):
        return None
    tokens, scores, types = [], [], []
    for text, score, kind in vocab.all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(int(kind))
    return tokens, scores, types


def looks_special(token: str) -> bool:
    """TextModel.does_token_look_special: added tokens the converter marks CONTROL by their text."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
            or (token.startswith("<unused") and token.endswith(">")))


def _gpt2_vocab(path: Path, vocab_size: int) -> tuple[list[str], list[int], str]:
    """get_vocab_base: the token texts and types of a GPT-2 BPE, and its pre-tokenizer name."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    pre = bpe_pre_tokenizer(tok, path)
    reverse = {i: text for text, i in tok.vocab.items()}
    added, decoder = tok.get_added_vocab(), tok.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(int(gguf.TokenType.UNUSED))
            continue
        text, kind = reverse[i], gguf.TokenType.NORMAL
        if text in added:
            # llama.cpp takes added tokens as pre-normalised: normalise those the tokenizer normalises
            if not decoder[i].normalized:
                text = tok.decode(tok.encode(text, add_special_tokens=False))
            if decoder[i].special or looks_special(text):
                kind = gguf.TokenType.CONTROL
            else:
                text, kind = text.replace("\u2581", " "), gguf.TokenType.USER_DEFINED
        tokens.append(text)
        types.append(int(kind))
    return tokens, types, pre


# convert_hf_to_gguf.py names a BPE pre-tokenizer by hashing how it splits this text
# (get_vocab_base_pre); the same text, and the hashes of the targets EAGLE-3 heads are made for.
BPE_CHECK_TEXT = (
    '\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n\U0001f680 (normal) \U0001f636'
    '\u200d\U0001f32b\ufe0f (multiple emojis concatenated) \u2705 \U0001f999\U0001f999 3 '
    '33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 \u1780\u17b6\u1793\u17cb'
    '\u178f\u17c2\u1796\u17b7\u179f\u17c1\u179f\u17a2\u17b6\u1785\U0001f601 ?\u6211\u60f3'
    '\u5728apple\u5de5\u4f5c1314151\u5929\uff5e ------======= \u043d\u0435\u0449\u043e '
    '\u043d\u0430 \u0411\u044a\u043b\u0433\u0430\u0440\u0441\u043a\u0438 \'\'\'\'\'\'````'
    '```""""......!!!!!!?????? I\'ve been \'told he\'s there, \'RE you sure? \'M not sure'
    ' I\'ll make it, \'D you like some tea? We\'Ve a\'lL'
)
BPE_PRE_TOKENIZERS = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Meta-Llama-3-8B
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # SmolLM-135M
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen1.5-7B
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",  # Qwen3-Embedding-0.6B
    "d30d75d9059f1aa2c19359de71047b3ae408c70875e8a3ccf8c5fba56c9d8af4": "qwen35",  # Qwen3.5-9B-Instruct
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",  # openai-community/gpt2
    "ccc2ef013c104be7bae2965776d611e1d7a8a2a9c547dd93a682c9a9fc80352e": "gpt-4o",  # Xenova/gpt-4o
    "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e": "tekken",  # Mistral-Nemo-Base-2407
    "877081d19cf6996e2c4ff0e1236341e9b7bde288f5311a56a937f0afbbb3aeb5": "deepseek-v3",  # DeepSeek-V3
}


def bpe_pre_tokenizer(tokenizer: Any, where: Path) -> str:
    """The converter's name for this BPE tokenizer's pre-tokenizer. Raises ModelLoadError."""
    chkhsh = sha256(str(tokenizer.encode(BPE_CHECK_TEXT)).encode()).hexdigest()
    try:
        return BPE_PRE_TOKENIZERS[chkhsh]
    except KeyError:
        raise ModelLoadError(f"{where}: a BPE tokenizer whose pre-tokenizer livedraft does not know "
                             f"(hash {chkhsh[:12]}): give --target as the target's GGUF file, "
                             "whose tokenizer is copied as it is") from None


class SpecialVocab(gguf.SpecialVocab):
    """gguf's SpecialVocab with llama.cpp's current tokenizer.json rules (gguf-py in llama.cpp is
    ahead of the PyPI release): ByteLevel post-processors, normalizer flags, and add_*_token from
    the post-processor winning over tokenizer_config."""

    def __init__(self, path: str | Path, load_merges: bool = False, n_vocab: int | None = None) -> None:
        self.normalizer_lowercase: bool | None = None
        self.normalizer_strip_accents: bool | None = None
        super().__init__(path, load_merges=load_merges, n_vocab=n_vocab)

    def add_to_gguf(self, gw: gguf.GGUFWriter, quiet: bool = True) -> None:
        super().add_to_gguf(gw, quiet=quiet)
        if self.normalizer_lowercase is not None:
            gw.add_bool("tokenizer.ggml.normalizer.lowercase", self.normalizer_lowercase)
        if self.normalizer_strip_accents is not None:
            gw.add_bool("tokenizer.ggml.normalizer.strip_accents", self.normalizer_strip_accents)

    def _try_load_from_tokenizer_json(self, path: Path) -> bool:
        tokenizer = _json(path / "tokenizer.json")
        config = _json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").is_file() else None
        if tokenizer:
            if self.load_merges:
                self.merges = merges_of(tokenizer)
            self._parse_normalizer(tokenizer.get("normalizer") or {})
            if post := tokenizer.get("post_processor"):
                self._parse_post_processor(post, config)
        if not config:
            return True
        self.chat_template = _chat_template(path, config)
        self._from_tokenizer_config(config, tokenizer.get("added_tokens", []) if tokenizer else [])
        return True

    def _parse_normalizer(self, normalizer: dict[str, Any]) -> None:
        kind = normalizer.get("type")
        if kind == "Lowercase":
            self.normalizer_lowercase = True
        elif kind == "StripAccents":
            self.normalizer_strip_accents = True
        elif kind == "BertNormalizer":
            self.normalizer_lowercase = normalizer.get("lowercase", self.normalizer_lowercase)
            self.normalizer_strip_accents = normalizer.get("strip_accents", self.normalizer_strip_accents)
        elif kind == "Sequence":
            for n in normalizer.get("normalizers", []):
                self._parse_normalizer(n)

    def _parse_post_processor(self, post: dict[str, Any], config: dict[str, Any] | None) -> None:
        c = config or {}
        bos, cls_ = c.get("bos_token"), c.get("cls_token")
        eos, sep = c.get("eos_token"), c.get("sep_token")
        if not bos and cls_ and config:
            config["bos_token"] = bos = cls_
        if not eos and sep and config:
            config["eos_token"] = eos = sep
        for proc in post.get("processors", [post]):
            kind = proc.get("type")
            if kind == "ByteLevel":
                self.add_special_token.setdefault("bos", False)
                self.add_special_token.setdefault("eos", False)
            elif kind == "RobertaProcessing":
                self.add_special_token.update(bos=True, eos=True, sep=True)
                if not cls_ and config:
                    config["cls_token"] = cls_ = proc.get("cls", [bos])[0]
                if not sep and config:
                    config["sep_token"] = sep = proc.get("sep", [eos])[0]
            elif kind == "TemplateProcessing":
                self._parse_template(proc, config, bos, cls_, eos, sep)

    def _parse_template(self, proc: dict[str, Any], config: dict[str, Any] | None, bos: Any, cls_: Any,
                        eos: Any, sep: Any) -> None:
        """The converter's crude reading of TemplateProcessing: whether BOS/EOS/SEP are added."""
        single, pair = proc.get("single", []), proc.get("pair", [])
        first = last = None
        if len(single) > 1:
            if first := single[0].get("SpecialToken", {}).get("id"):
                if not config:
                    bos = first
                elif first not in (bos, cls_):
                    if not bos:
                        config["bos_token"] = bos = first
                    if not cls_:
                        config["cls_token"] = cls_ = first
                self.add_special_token["bos"] = first in (bos, cls_)
            if last := single[-1].get("SpecialToken", {}).get("id"):
                if not config:
                    eos = last
                elif last != eos:
                    if "eot" not in self.special_token_types:
                        self.special_token_types = (*self.special_token_types, "eot")
                        config["eot_token"] = eos
                    elif "eom" not in self.special_token_types:
                        self.special_token_types = (*self.special_token_types, "eom")
                        config["eom_token"] = eos
                    config["eos_token"] = eos = last
                self.add_special_token["eos"] = last == eos
        if not pair:
            return
        start = 1 if first and pair[0].get("SpecialToken", {}).get("id") == first else 0
        stop = -1 if last and pair[-1].get("SpecialToken", {}).get("id") == last else None
        pair = pair[slice(start, stop)]
        if not pair or pair[0].get("Sequence", {}).get("id") != "A" or pair[-1].get("Sequence", {}).get("id") != "B":
            return
        middle = pair[1:-1]
        if not middle:
            return
        add_sep = False
        if (entry := middle[0].get("SpecialToken", {}).get("id")) and entry in (sep, eos) and not last:
            add_sep = True
        if len(middle) == 2 and (entry := middle[1].get("SpecialToken", {}).get("id")) and entry in (sep, eos):
            add_sep = True
        self.add_special_token["sep"] = add_sep
        if add_sep and not sep and config:
            config["sep_token"] = eos

    def _from_tokenizer_config(self, config: dict[str, Any], added_tokens: list[dict[str, Any]]) -> None:
        for typ in self.special_token_types:
            add = config.get(f"add_{typ}_token")
            if isinstance(add, bool) and typ not in self.add_special_token:
                self.add_special_token[typ] = add  # a post-processor's reading wins, as in llama.cpp
            entry = config.get(f"{typ}_token")
            content = entry.get("content") if isinstance(entry, dict) else entry
            if isinstance(content, str):
                self._set_special_token(typ, next((a.get("id") for a in added_tokens if a.get("content") == content),
                                                  None))


def merges_of(tokenizer: dict[str, Any]) -> list[str]:
    """BPE merges as "a b" strings (the list-of-pairs format with spaces encoded as U+0120 + 256)."""
    merges = tokenizer.get("model", {}).get("merges")
    if not isinstance(merges, list) or not merges:
        return []
    if isinstance(merges[0], str):
        return merges
    if isinstance(merges[0], list) and len(merges[0]) == 2 and isinstance(merges[0][0], str):
        return [" ".join("".join(chr(ord(c) + 256) if c == " " else c for c in part) for part in pair)
                for pair in merges]
    raise ModelLoadError("tokenizer.json: unknown BPE merges format")


def _chat_template(path: Path, config: dict[str, Any]) -> str | Sequence[dict[str, str]] | None:
    alt: str | list[dict[str, str]] | None = None
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        alt = jinja.read_text(encoding="utf-8")
        if extra := list((path / "additional_chat_templates").glob("*.jinja")):
            alt = [{"name": "default", "template": alt}] + [
                {"name": p.stem, "template": p.read_text(encoding="utf-8")} for p in extra]
    elif (path / "chat_template.json").is_file():
        alt = _json(path / "chat_template.json").get("chat_template")
    template = config.get("chat_template", alt)
    return template if template is None or isinstance(template, str | list) else None

