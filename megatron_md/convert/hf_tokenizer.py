"""The run's tokenizer for a Hugging Face export (``write_hf_tokenizer``).

A Hugging Face or GPT-2 BPE tokenizer is written as it is. A SentencePiece model becomes a Hugging
Face fast tokenizer that encodes the same ids: the ``tokenizer.json`` is built from the model's own settings (pieces, scores, normalizer spec),
so ``AutoTokenizer.from_pretrained`` needs neither ``sentencepiece`` nor a slow-tokenizer class:
BPE merges are ranked by piece score (SentencePiece's merge order), byte fallback is kept, and
spaces become ``▁``. Special tokens (``<s>``, ``</s>``, ``<pad>``) are not matched inside text
(``split_special_tokens``), as in SentencePiece, and nothing is added around the ids: ``encode``
returns what megatron-core's SentencePiece tokenizer (``build_tokenizer``) returns. The export checks this
on a sample before it writes anything.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from megatron_md.convert.mappings import ConversionError

# Text exercising what differs between tokenizers: runs of spaces, tabs, newlines, digits,
# non-Latin scripts and characters outside the vocabulary (byte fallback), special-token text.
SAMPLE_TEXTS = (
    "The for statement in Python differs a bit from what you may be used to in C or Pascal.",
    "def f(x):\n    return x ** 2  # 12345 and 3.14159\n\n\tindented\ttabs  and   spaces ",
    "ünïcödé, 日本語, Ελληνικά, emoji 😀 and <s> </s> <pad> written as text",
    "  leading spaces, trailing newline\n",
)

_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4  # SentencePiece piece types


def _proto(sp_model: str | Path):
    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()
    m.ParseFromString(Path(sp_model).read_bytes())
    return m


def build_tokenizer(sp_model: str | Path):
    """A ``tokenizers.Tokenizer`` equivalent to the SentencePiece model (BPE or unigram)."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers
    from tokenizers.models import BPE, Unigram

    proto = _proto(sp_model)
    spec, norm = proto.trainer_spec, proto.normalizer_spec
    pieces = list(proto.pieces)
    if spec.model_type == 2:  # BPE
        vocab = {p.piece: i for i, p in enumerate(pieces)}
        normal = {p.piece: (p.score, i) for i, p in enumerate(pieces) if p.type == _NORMAL}
        ranked = []
        for piece, (score, i) in normal.items():
            for cut in range(1, len(piece)):
                left, right = piece[:cut], piece[cut:]
                if left in normal and right in normal:
                    ranked.append((-score, i, left, right))  # SentencePiece merges the best-scored pair
        merges = [(left, right) for _, _, left, right in sorted(ranked)]
        model = BPE(vocab=vocab, merges=merges, unk_token=pieces[spec.unk_id].piece, fuse_unk=True,
                    byte_fallback=spec.byte_fallback)
    elif spec.model_type == 1:  # unigram
        model = Unigram([(p.piece, p.score) for p in pieces], unk_id=spec.unk_id, byte_fallback=spec.byte_fallback)
    else:
        raise ConversionError(f"{sp_model}: SentencePiece model type {spec.model_type} (word/char) is not supported")
    tok = Tokenizer(model)
    seq = []
    if norm.precompiled_charsmap:
        seq.append(normalizers.Precompiled(norm.precompiled_charsmap))
    if norm.remove_extra_whitespaces:
        seq += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if norm.add_dummy_prefix:
        seq.append(normalizers.Prepend(" "))
    if norm.escape_whitespaces:
        seq.append(normalizers.Replace(" ", "▁"))
    tok.normalizer = normalizers.Sequence(seq)
    dec = [decoders.Replace("▁", " ")]
    if spec.byte_fallback:
        dec.append(decoders.ByteFallback())
    dec.append(decoders.Fuse())
    if norm.add_dummy_prefix:
        dec.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(dec)
    return tok


def special_token_ids(sp_model: str | Path) -> dict:
    """bos/eos/pad token ids for the HF model config (None where the model has none)."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    ids = {"bos_token_id": sp.bos_id(), "eos_token_id": sp.eos_id(), "pad_token_id": sp.pad_id()}
    return {k: (v if v >= 0 else None) for k, v in ids.items()}


def save_hf_tokenizer(sp_model: str | Path, out_dir: str | Path, model_max_length: int) -> None:
    """Write tokenizer.json + tokenizer_config.json (+ the original tokenizer.model) into ``out_dir``."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    proto = _proto(sp_model)
    tok = build_tokenizer(sp_model)
    named = {}
    for i, p in enumerate(proto.pieces):
        if p.type == _USER_DEFINED:  # SentencePiece always emits these whole
            tok.add_tokens([AddedToken(p.piece, normalized=False, special=False)])
        if p.type in (_CONTROL, _UNKNOWN):
            role = {proto.trainer_spec.bos_id: "bos_token", proto.trainer_spec.eos_id: "eos_token",
                    proto.trainer_spec.pad_id: "pad_token", proto.trainer_spec.unk_id: "unk_token"}.get(i)
            if role:
                named[role] = p.piece
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, split_special_tokens=True, clean_up_tokenization_spaces=False,
        model_max_length=model_max_length, **named,
    )
    out = Path(out_dir)
    fast.save_pretrained(str(out))
    shutil.copy2(sp_model, out / "tokenizer.model")
    check_same_ids(sp_model, out)


def write_hf_tokenizer(data, tokenizer, out_dir: str | Path, model_max_length: int) -> dict:
    """Write the run's tokenizer into the export ``out_dir``; returns the bos/eos/pad ids for config.json.

    SentencePiece: converted to a tokenizer.json (``save_hf_tokenizer``). A Hugging Face or GPT-2 BPE
    tokenizer already is one: megatron-core's ``save_pretrained`` writes its files as the run read them."""
    from megatron_md.training.data.tokenizer import SENTENCEPIECE, data_tokenizer_kind

    if data_tokenizer_kind(data) == SENTENCEPIECE:
        save_hf_tokenizer(data.tokenizer_model, out_dir, model_max_length)
        return special_token_ids(data.tokenizer_model)
    tokenizer.save_pretrained(str(out_dir))
    check_same_ids(tokenizer, out_dir)
    ids = {"bos_token_id": tokenizer.bos, "eos_token_id": tokenizer.eod, "pad_token_id": tokenizer.pad}
    return {k: (int(v) if v is not None and v >= 0 else None) for k, v in ids.items()}


def check_same_ids(ours, hf_dir: str | Path, texts=SAMPLE_TEXTS) -> None:
    """Refuse (ConversionError) unless AutoTokenizer on ``hf_dir`` encodes ``texts`` like our tokenizer
    (``ours``: a SentencePiece model path or a megatron-core tokenizer)."""
    from transformers import AutoTokenizer

    from megatron_md.training.data.tokenizer import build_tokenizer

    what = ours
    if isinstance(ours, (str, Path)):
        ours = build_tokenizer("SentencePieceTokenizer", ours)
    else:
        what = f"tokenizer {getattr(ours, 'path', '')}"
    hf = AutoTokenizer.from_pretrained(str(hf_dir))
    for text in texts:
        a, b = ours.tokenize(text), hf.encode(text, verbose=False)
        if a != b:
            raise ConversionError(
                f"the Hugging Face tokenizer written to {hf_dir} encodes {text!r} as {b[:16]}... but the run's "
                f"{what} gives {a[:16]}...; not exporting a tokenizer that disagrees"
            )
