"""The tokenizer and the synthetic task."""

from __future__ import annotations

import pytest

from dsv4.tinylm.config import TinyLMConfig
from dsv4.tinylm.task import FILLER_CHARS, TaskSpec, heldout_problems, make_problems
from dsv4.tinylm.tokenizer import CharTokenizer, TokenizerError


def test_tokenizer_round_trip():
    tok = CharTokenizer()
    text = "a=37;xyz qrs b=45;mnop a+b=82"
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert len(ids) == len(text) + 2
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode("12") + [tok.eos_id] + tok.encode("99")) == "12"
    assert CharTokenizer.from_dict(tok.to_dict()).encode(text) == tok.encode(text)


def test_tokenizer_rejects_unknown_characters_and_ids():
    tok = CharTokenizer()
    with pytest.raises(TokenizerError, match=r"\['A', '~'\]"):
        tok.encode("a=1~A")
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.decode([len(tok)])


def test_heldout_set_is_fixed_and_deterministic():
    a, b = heldout_problems(), heldout_problems()
    assert len(a) == 400 and a == b
    assert heldout_problems(50) == a[:50]
    assert make_problems(5, seed=1) != a[:5]
    # pinned: a change of the generator would silently change every published number
    assert (a[0].a, a[0].b, a[0].answer, len(a[0].prompt)) == (21, 78, "99", 125)
    assert a[0].prompt.startswith("a=21;cxyhhjpx") and a[0].prompt.endswith("rma+b=")
    assert sum(p.a + p.b for p in a) == 37999
    with pytest.raises(ValueError, match="400"):
        heldout_problems(401)


def test_operands_lie_beyond_the_window():
    window = TinyLMConfig.preset().attn.sliding_window
    spec = TaskSpec()
    for p in heldout_problems():
        assert p.answer == str(p.a + p.b)
        b_end = p.prompt.index(f"b={p.b};") + len(f"b={p.b};")
        # tokens after b's ';' up to the last prompt token: more than the window
        assert len(p.prompt) - b_end > window
        assert len(p.prompt) <= spec.max_prompt_chars
        filler = p.prompt.replace(f"a={p.a};", "", 1).replace(f"b={p.b};", "", 1)[:-4]
        assert set(filler) <= set(FILLER_CHARS)

