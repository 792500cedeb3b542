"""CrossVocabDrafter (`--drafter-kind crossvocab`): a small LM with its own tokenizer drafts for any target.

OmniDraft (arXiv 2507.02659): the drafter keeps each request's context in its own vocabulary,
drafts in its own tokens, and the draft is translated into target tokens before the target
verifies it — so the verifier sees target tokens only and decoding stays lossless (the
translated draft's q is one-hot, as for model-free drafters).

- The context moves target ids -> text -> drafter ids incrementally: the text of a stable
  prefix of target tokens is kept, and so are the drafter ids of the text up to the last
  word boundary a window back (`Codec` learns at start how the drafter's tokenizer splits
  text at spaces: SentencePiece drops the space, byte-level BPE keeps it); only the tail is
  re-encoded each step. A context that is not an extension of the last one (a rewind) is
  re-encoded from scratch.
- Translation, per draft: where the online n-gram cache (`VocabBridge`) knows a drafter
  n-gram (the target tokens that text became in earlier outputs), its target tokens; else
  the draft's text (decoded after the drafter's own context, so spaces and partial UTF-8
  come out right) is re-encoded by the target tokenizer after the last few target tokens
  of the context; only target tokens whose text lies inside the draft are kept (the last
  one may continue past it), and none when the target would merge across the boundary.
  The drafter's end-of-text maps to the target's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from runtime.drafters.base import Draft, DraftRow
from runtime.drafters.model import ModelDrafter

REPLACEMENT = "\ufffd"  # what decode yields for an incomplete UTF-8 sequence


class Codec:
    """A tokenizer as translation needs it: text <-> ids without special-token handling, and how
    encodings concatenate at a space (`drops_space`: SentencePiece; `keeps_space`: byte-level BPE)."""

    def __init__(self, tokenizer: Any) -> None:  # noqa: ANN401 - any Hugging Face tokenizer
        self.tok = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.bos_id = tokenizer.bos_token_id
        probe, a, b = "hello world, all good", "hello world,", "all good"
        self.drops_space = self.encode(probe) == self.encode(a) + self.encode(b)
        self.keeps_space = not self.drops_space and self.encode(probe) == self.encode(a) + self.encode(" " + b)

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False).input_ids) if text else []

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def text_after(self, left: Sequence[int], ids: Sequence[int]) -> str:
        """The text `ids` add after `left` (decoding them alone can drop a leading space or split
        a character)."""
        if not left:
            return self.decode(ids)
        base = self.decode(left)
        full = self.decode([*left, *ids])
        return full[len(base):] if full.startswith(base) else self.decode(ids)

    def concat(self, prefix_ids: list[int], prefix_len: int, text: str) -> list[int] | None:
        """Ids of text[:prefix_len] + text[prefix_len:] given the ids of the first part, when the
        split is at a space; None when this tokenizer does not concatenate that way."""
        rest = text[prefix_len:]
        if prefix_len == 0:
            return self.encode(rest)
        if not rest.startswith(" "):
            return None
        if self.drops_space:
            return prefix_ids + self.encode(rest[1:])
        if self.keeps_space:
            return prefix_ids + self.encode(rest)
        return None


@dataclass
class TextView:
    """Target token ids -> text, decoding only the tokens after the last complete-text boundary."""

    codec: Codec
    ids: list[int] = field(default_factory=list)
    stable: int = 0  # ids[:stable] are decoded into stable_text
    stable_text: str = ""
    text: str = ""

    def update(self, ids: Sequence[int]) -> str:
        ids = list(ids)
        if ids[: self.stable] != self.ids[: self.stable]:  # rewound: start over
            self.stable, self.stable_text = 0, ""
        self.ids = ids
        left = ids[self.stable - 1 : self.stable] if self.stable else []
        tail = self.codec.text_after(left, ids[self.stable :])
        self.text = self.stable_text + tail
        # keep all but the last 4 tokens stable, if their text ends on a whole character
        cut = max(self.stable, len(ids) - 4)
        if cut > self.stable:
            part = self.codec.text_after(left, ids[self.stable : cut])
            if not part.endswith(REPLACEMENT) and self.text.startswith(self.stable_text + part):
                self.stable, self.stable_text = cut, self.stable_text + part
        return self.text


@dataclass
class TokenView:
    """Text -> drafter ids, re-encoding only the text after the last space a window back."""

    codec: Codec
    window: int = 24  # characters at the end re-encoded every update
    text: str = ""
    stable_len: int = 0  # text[:stable_len] is encoded as stable_ids
    stable_ids: list[int] = field(default_factory=list)

    def update(self, text: str) -> list[int]:
        if not text.startswith(self.text[: self.stable_len]):
            self.stable_len, self.stable_ids = 0, []
        self.text = text
        split = _word_space(text, self.stable_len + 1, len(text) - self.window)
        if split > self.stable_len:
            ids = self.codec.concat(self.stable_ids, self.stable_len, text[:split])
            if ids is not None:
                self.stable_len, self.stable_ids = split, ids
        ids = self.codec.concat(self.stable_ids, self.stable_len, text)
        return ids if ids is not None else self.codec.encode(text)


def _word_space(text: str, lo: int, hi: int) -> int:
    """The last index in [lo, hi) of a single space between two non-space characters, or -1."""
    i = text.rfind(" ", lo, max(hi, 0))
    while i >= lo:
        if 0 < i < len(text) - 1 and not text[i - 1].isspace() and not text[i + 1].isspace():
            return i
        i = text.rfind(" ", lo, i)
    return -1


def aligned_segments(target: Codec, drafter: Codec, target_ids: Sequence[int], max_n: int = 4
                     ) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(drafter n-gram, target tokens) pairs that spell the same text in `target_ids`: both
    tokenizations of its text cut at every character position where both have a token
    boundary; pieces longer than `max_n` tokens on either side are skipped."""
    text = target.decode(target_ids)
    d_ids = drafter.encode(text)

    lead = len(text) - len(text.lstrip(" "))  # SentencePiece decodes a leading space away

    def ends(codec: Codec, ids: Sequence[int]) -> dict[int, int]:
        """Character position where each prefix of `ids` ends -> its length in tokens."""
        out, last = {}, 0
        for j in range(1, len(ids) + 1):
            s = codec.decode(ids[:j])
            if s.endswith(REPLACEMENT):
                continue
            pos = len(s) if text.startswith(s) else lead + len(s) if text[lead:].startswith(s) else -1
            if pos > last:
                out[pos] = j
                last = pos
        return out

    t_end, d_end = ends(target, target_ids), ends(drafter, d_ids)
    pairs, ti, di = [], 0, 0
    for pos in sorted(set(t_end) & set(d_end)):
        tj, dj = t_end[pos], d_end[pos]
        if 0 < dj - di <= max_n and 0 < tj - ti <= max_n:
            pairs.append((tuple(d_ids[di:dj]), tuple(target_ids[ti:tj])))
        ti, di = tj, dj
    return pairs


@dataclass
class _Request:
    text: TextView
    tokens: TokenView
    tag: str | None


class CrossVocabDrafter:
    """Drafts with `model` (its own tokenizer `drafter_tokenizer`) for a target whose tokenizer
    is `target_tokenizer`. `bridge` (a VocabBridge) is the online n-gram cache: read when
    translating, written through with each finished request's output (None: text only)."""

    uses_features = False

    def __init__(self, model: Any, drafter_tokenizer: Any, target_tokenizer: Any, *,  # noqa: ANN401
                 bridge: Any = None, version: str = "crossvocab", tokens_per_target: float = 2.0) -> None:
        self.inner = ModelDrafter(model, int(model.config.vocab_size), version=version)
        self.d, self.t = Codec(drafter_tokenizer), Codec(target_tokenizer)
        self.bridge, self.version = bridge, version
        self.tokens_per_target = tokens_per_target  # drafter tokens drafted per target token wanted
        self.target_vocab_size = len(target_tokenizer)
        self._requests: dict[str, _Request] = {}

    def begin(self, req_id: str, prompt_ids: list[int], *, tag: str | None = None) -> None:
        if req_id in self._requests:
            raise ValueError(f"request {req_id!r} already begun")
        self.inner.begin(req_id, [], tag=tag)
        self._requests[req_id] = _Request(TextView(self.t), TokenView(self.d), tag)

    def end(self, req_id: str, output_ids: list[int] | None = None) -> None:
        st = self._requests.pop(req_id, None)
        self.inner.end(req_id)
        if st is not None and output_ids is not None and self.bridge is not None:
            self.bridge.write_through(req_id, output_ids, st.tag)

    def propose(self, rows: Sequence[DraftRow]) -> list[Draft]:
        inner_rows, views = [], []
        for row in rows:
            st = self._requests.get(row.req_id)
            if st is None:
                raise ValueError(f"request {row.req_id!r} was not begun")
            text = st.text.update(row.context)
            d_ctx = st.tokens.update(text)
            if self.d.bos_id is not None:
                d_ctx = [self.d.bos_id, *d_ctx]
            k = round(row.max_tokens * self.tokens_per_target) if row.max_tokens > 0 else 0
            if not d_ctx:
                k = 0
            inner_rows.append(DraftRow(row.req_id, d_ctx or [self.d.bos_id or 0], k))
            views.append((row, st, d_ctx))
        drafted = self.inner.propose(inner_rows)
        out = []
        for (row, st, d_ctx), d in zip(views, drafted, strict=True):
            tokens = self.translate(row.context, d_ctx, d.tokens, row.max_tokens, st.tag) if d.tokens else []
            out.append(Draft(tokens, "crossvocab"))
        return out

    def translate(self, context: Sequence[int], d_ctx: Sequence[int], draft: Sequence[int], max_tokens: int,
                  tag: str | None = None) -> list[int]:
        """Target tokens for the drafter tokens `draft` continuing `d_ctx` (the drafter's view of the
        target `context`), at most `max_tokens`."""
        eos = self.d.eos_id is not None and self.d.eos_id in draft
        if eos:
            draft = list(draft[: list(draft).index(self.d.eos_id)])
        out: list[int] = []
        i = 0
        while i < len(draft) and self.bridge is not None:
            hit = self.bridge.lookup(draft[i:], tag)
            if hit is None:
                break
            n, target = hit
            out += target
            i += n
        if i < len(draft):
            text = self.d.text_after(list(d_ctx) + list(draft[:i]), draft[i:]).rstrip(REPLACEMENT)
            out += by_text(self.t, [*context, *out], text, complete=eos)
        elif eos and self.t.eos_id is not None:
            out.append(self.t.eos_id)
        if eos and i < len(draft) and out and self.t.eos_id is not None and out[-1] != self.t.eos_id:
            out.append(self.t.eos_id)
        return out[:max_tokens]


def by_text(target: Codec, context: Sequence[int], text: str, *, complete: bool = False, tail: int = 3) -> list[int]:
    """Target tokens that spell `text` right after `context`: the text is encoded after the text of
    the context's last `tail` tokens, which must come out as those same tokens (else the target
    would merge across the boundary: fewer tail tokens are tried, then nothing). Tokens reaching
    the end of `text` are dropped unless `complete` (the text may continue into a longer token)."""
    if not text:
        return []
    for n in range(min(tail, len(context)), 0, -1):
        left, last = list(context[: len(context) - n]), list(context[len(context) - n :])
        tail_text = target.text_after(left[-1:], last)
        ids = target.encode(tail_text + text)
        if ids[:n] != last:
            continue
        cand, kept, spelled = ids[n:], [], ""
        for tok in cand:
            piece = target.text_after([*last, *kept], [tok])
            if not text.startswith(spelled + piece):
                break
            spelled += piece
            if len(spelled) == len(text) and not complete:
                break
            kept.append(tok)
        return kept
    return []
