"""Incremental detokenization and stop strings: streamed chunks concatenate to the
full decode whatever the chunking, never show a half character, and never show
text that a stop string later swallows."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from loraplex.daemon.detokenizer import IncrementalDetokenizer, StopStringMatcher, load_tokenizer

FFFD = "\ufffd"
# Multi-byte characters that the demo BPE splits across tokens: 2-, 3- and 4-byte UTF-8,
# a combining accent, a ZWJ emoji sequence and a flag (regional indicators).
TRICKY = [
    "é", "ß", "Ω", "世", "界", "語", "€", "😀", "🎉", "🦀", "👩\u200d💻", "🇩🇪", "e\u0301", "\u00a0", "\n", "\t", " ",
]
TEXT = st.lists(
    st.one_of(
        st.sampled_from(TRICKY),
        st.sampled_from(list("the harbour town ")),
        st.characters(exclude_categories=("Cs",)),
    ),
    max_size=40,
).map("".join)
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    from loraplex.gpu_engine.demo import build_demo_tokenizer

    return build_demo_tokenizer()


def chunked(ids: list[int], data: st.DataObject) -> list[list[int]]:
    """`ids` cut into random chunks (empty ones included: a step may sample nothing for us)."""
    sizes = data.draw(st.lists(st.integers(0, 4), max_size=len(ids) + 2), label="chunk sizes")
    chunks: list[list[int]] = []
    i = 0
    for n in sizes:
        chunks.append(ids[i:i + n])
        i += n
    return chunks + [ids[i:]]


def stream(detok: IncrementalDetokenizer, chunks: list[list[int]]) -> list[str]:
    return [detok.push(chunk) for chunk in chunks] + [detok.flush()]


@SETTINGS
@given(text=TEXT, data=st.data())
def test_streamed_text_equals_full_decode(tok: Tokenizer, text: str, data: st.DataObject) -> None:
    ids = tok.encode(text).ids
    full = tok.decode(ids, skip_special_tokens=True)
    pieces = stream(IncrementalDetokenizer(tok), chunked(ids, data))
    assert "".join(pieces) == full
    if FFFD not in full:
        assert not any(FFFD in p for p in pieces), pieces


def stray_byte_ids(tok: Tokenizer) -> list[int]:
    """Tokens that are one byte >= 0x80 on their own (lead or continuation bytes)."""
    return [i for i in range(tok.get_vocab_size()) if tok.decode([i]) == FFFD]


@SETTINGS
@given(skip=st.booleans(), data=st.data())
def test_arbitrary_token_ids_equal_full_decode(tok: Tokenizer, skip: bool, data: st.DataObject) -> None:
    """Model output can be any ids: invalid UTF-8 byte runs and special tokens included."""
    any_id = st.one_of(st.integers(0, tok.get_vocab_size() - 1), st.sampled_from(stray_byte_ids(tok)))
    ids = data.draw(st.lists(any_id, max_size=60), label="ids")
    full = tok.decode(ids, skip_special_tokens=skip)
    pieces = stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), chunked(ids, data))
    assert "".join(pieces) == full


def byte_token_ids(tok: Tokenizer) -> dict[int, int]:
    """Byte value -> id of the byte-level token that is exactly that byte (GPT-2 byte-to-char map)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    chars = {b: chr(b) for b in printable}
    chars.update({b: chr(256 + n) for n, b in enumerate(b for b in range(256) if b not in chars)})
    ids = {b: tok.token_to_id(c) for b, c in chars.items()}
    assert None not in ids.values()
    return ids  # type: ignore[return-value]


@SETTINGS
@given(
    parts=st.lists(
        st.one_of(st.sampled_from(TRICKY).map(str.encode), st.binary(min_size=1, max_size=2)), max_size=25
    ),
    data=st.data(),
)
def test_byte_by_byte_tokens_with_broken_utf8(tok: Tokenizer, parts: list[bytes], data: st.DataObject) -> None:
    """One token per byte: characters split every way, truncated and interleaved with stray bytes."""
    to_id = byte_token_ids(tok)
    ids = [to_id[b] for b in b"".join(parts)]
    pieces = stream(IncrementalDetokenizer(tok), chunked(ids, data))
    assert "".join(pieces) == tok.decode(ids)


def test_window_cut_never_splits_a_character(tok: Tokenizer) -> None:
    to_id = byte_token_ids(tok)
    # stray lead bytes keep the window open; then F0 9F 98 is cut off by a new lead byte
    # right where the window would be cut (3 tokens from the end)
    raw = b"\xe2" * 10 + b"\xf0\x9f\x98\xe2" + b"\x82\xac ok"
    ids = [to_id[b] for b in raw]
    assert "".join(stream(IncrementalDetokenizer(tok), [[i] for i in ids])) == tok.decode(ids)


def test_stray_bytes_keep_the_window_bounded(tok: Tokenizer) -> None:
    """A model emitting only stray bytes never ends cleanly; the window must not grow with it."""
    stray = stray_byte_ids(tok)
    assert len(stray) >= 64
    ids = [stray[i % len(stray)] for i in range(3000)] + tok.encode("done 😀").ids
    detok = IncrementalDetokenizer(tok)
    pieces = []
    for token_id in ids:
        pieces.append(detok.push([token_id]))
        assert detok.num_output_tokens - detok._prefix <= 16  # O(window) per token, not O(sequence)
    pieces.append(detok.flush())
    assert "".join(pieces) == tok.decode(ids)


@SETTINGS
@given(prompt=TEXT, output=TEXT, data=st.data())
def test_prompt_context_is_not_repeated(tok: Tokenizer, prompt: str, output: str, data: st.DataObject) -> None:
    prompt_ids, output_ids = tok.encode(prompt).ids, tok.encode(output).ids
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt_ids)
    assert "".join(stream(detok, chunked(output_ids, data))) == tok.decode(output_ids)
    assert detok.num_output_tokens == len(output_ids)


def test_split_character_is_held_until_complete(tok: Tokenizer) -> None:
    ids = tok.encode("a😀b").ids
    assert len(ids) >= 4  # the emoji's four bytes span several tokens
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push([i]) for i in ids]
    assert "".join(pieces) == "a😀b"
    assert "😀" in pieces and all(FFFD not in p for p in pieces)
    assert detok.flush() == ""


def test_incomplete_character_is_released_by_flush(tok: Tokenizer) -> None:
    ids = tok.encode("x😀").ids[:-1]  # drop the emoji's last byte
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids) == "x"
    assert detok.flush() == tok.decode(ids)[1:] and detok.flush() == ""


def test_special_tokens(tok: Tokenizer) -> None:
    ids = [1] + tok.encode("hi").ids + [2]
    assert "".join(stream(IncrementalDetokenizer(tok), [ids])) == "hi"
    assert "".join(stream(IncrementalDetokenizer(tok, skip_special_tokens=False), [ids])) == "<s>hi</s>"


def test_leading_space_decoders_use_the_prompt_as_context() -> None:
    """SentencePiece-style decoders drop the space of a string's first word; with the
    prompt as context the first output word keeps its space."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"], show_progress=False)
    tok.train_from_iterator(["the harbour town woke slowly on winter mornings", "the river"], trainer=trainer)
    ids = tok.encode("the river woke the town").ids
    detok = IncrementalDetokenizer(tok, prompt_ids=ids[:2])
    assert [detok.push([i]) for i in ids[2:]] == [" woke", " the", " town"]
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.push([i]) for i in ids) == tok.decode(ids) == "the river woke the town"


def test_load_tokenizer(tmp_path: Path, tok: Tokenizer) -> None:
    assert load_tokenizer(tmp_path) is None
    (tmp_path / "tokenizer.json").write_text(tok.to_str())
    loaded = load_tokenizer(tmp_path)
    assert loaded is not None and loaded.encode("the town").ids == tok.encode("the town").ids
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        load_tokenizer(tmp_path)


# ---- stop strings ------------------------------------------------------------------------------


def reference_cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """Text before the stop occurrence that completes first (longest on ties)."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text.endswith(s, 0, end)]
        if hits:
            return text[: end - max(map(len, hits))], True
    return text, False


def split_text(text: str, data: st.DataObject) -> list[str]:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8), label="cuts"))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet="abc\n", max_size=30),
    stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), min_size=1, max_size=3),
    data=st.data(),
)
def test_stop_matcher_equals_reference_for_any_chunking(text: str, stops: list[str], data: st.DataObject) -> None:
    matcher = StopStringMatcher(stops)
    emitted: list[str] = []
    hit = False
    for chunk in split_text(text, data):
        out, hit = matcher.feed(chunk)
        emitted.append(out)
        assert not any(s in "".join(emitted) for s in stops)  # never shows a stop, even partially completed later
        if hit:
            break
    emitted.append(matcher.flush())
    expected, expected_hit = reference_cut(text, stops)
    assert "".join(emitted) == expected
    assert hit == expected_hit == matcher.stopped
    if hit:
        assert matcher.matched in stops


def test_stop_across_chunks_and_after_stop() -> None:
    matcher = StopStringMatcher(["\nUser:"])
    assert matcher.feed("Hello") == ("Hello", False)
    assert matcher.feed(" there\nUs") == (" there", False)  # "\nUs" could start the stop: held
    assert matcher.feed("er: more") == ("", True)
    assert matcher.matched == "\nUser:"
    assert matcher.feed("anything") == ("", True)
    assert matcher.flush() == ""


def test_held_tail_is_released_when_it_cannot_match() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("go ST") == ("go ", False)
    assert matcher.feed("ay") == ("STay", False)
    assert matcher.feed("ST") == ("", False)
    assert matcher.flush() == "ST"


def test_stop_matcher_edge_cases() -> None:
    assert StopStringMatcher([]).feed("abc") == ("abc", False)
    assert StopStringMatcher(["x", "x"]).feed("axb") == ("a", True)
    assert StopStringMatcher(["abc", "b"]).feed("abc") == ("a", True)  # "b" completes first
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher([""])


@SETTINGS
@given(text=TEXT, stop=st.sampled_from(["😀", "世界", " town", "\n\n"]), data=st.data())
def test_detokenizer_feeding_stop_matcher(tok: Tokenizer, text: str, stop: str, data: st.DataObject) -> None:
    """The daemon's pipeline: ids -> final text -> stop cut, equal to cutting the full decode."""
    ids = tok.encode(text).ids
    detok, matcher = IncrementalDetokenizer(tok), StopStringMatcher([stop])
    out: list[str] = []
    for chunk in chunked(ids, data):
        emitted, hit = matcher.feed(detok.push(chunk))
        out.append(emitted)
        if hit:
            break
    else:
        out.append(matcher.feed(detok.flush())[0])
        out.append(matcher.flush())
    assert "".join(out) == reference_cut(tok.decode(ids), [stop])[0]
