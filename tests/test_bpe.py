"""The project's own small Qwen3-style tokenizer (gyrejax/harness/bpe.py)."""

import pytest
from transformers import AutoTokenizer

from gyrejax.harness import bpe

ADDED = (*bpe.SPECIAL_TOKENS, *bpe.MARKUP_TOKENS)


@pytest.fixture(scope="module")
def hf(bpe_tokenizer):
    return AutoTokenizer.from_pretrained(str(bpe_tokenizer))


def test_loads_through_auto_tokenizer_with_qwen3s_added_tokens(bpe_tokenizer, hf):
    assert {p.name for p in bpe_tokenizer.iterdir()} >= {"tokenizer.json", "tokenizer_config.json"}
    assert len(hf) == 1024
    ids = [hf.convert_tokens_to_ids(t) for t in ADDED]
    assert ids == list(range(1024 - len(ADDED), 1024))  # after the BPE vocabulary
    for token, i in zip(ADDED, ids, strict=True):  # each one id, wherever it appears
        assert hf.encode(f"x{token}y", add_special_tokens=False)[1:-1] == [i]
    assert hf.eos_token == "<|im_end|>" and hf.pad_token == "<|endoftext|>"
    assert hf.encode("a b", add_special_tokens=True) == hf.encode("a b", add_special_tokens=False)
    # Markup is not special (as in Qwen3): decoding without specials keeps it.
    text = "<think>x</think><tool_call>{}</tool_call><|im_end|>"
    assert hf.decode(hf.encode(text), skip_special_tokens=True) == text.replace("<|im_end|>", "")


@pytest.mark.parametrize(
    "text",
    ["def f(x):\n    return x  # é", "日本語 \x00\x7f\ttabs\r\n\n\n", "  <think>  ", "🙂" * 3],
)
def test_any_text_round_trips(hf, text):
    ids = hf.encode(text, add_special_tokens=False)
    assert hf.decode(ids, skip_special_tokens=False) == text


def test_learned_merges_compress_the_source_it_was_trained_on(hf):
    text = (bpe.corpus_files()[0].parent / "config.py").read_text()
    assert len(hf.encode(text, add_special_tokens=False)) < len(text.encode()) / 2


def test_chat_template_renders_qwen3s_layout(hf):
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {}}}]
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "list"},
        {
            "role": "assistant",
            "content": "<think>\nok\n</think>",
            "tool_calls": [
                {"type": "function", "function": {"name": "ls", "arguments": {}}},
                {"function": {"name": "ls", "arguments": '{"a": 1}'}},
            ],
        },
        {"role": "tool", "content": "a.txt"},
        {"role": "tool", "content": "b.txt"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "and"}, {"type": "text", "text": "?"}],
        },
    ]
    text = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nbe brief\n\n# Tools\n")
    assert (
        '\n<tools>\n{"type": "function", "function": {"name": "ls", "parameters": {}}}\n' in system
    )
    assert rest == (
        "<|im_start|>user\nlist<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nok\n</think>\n"
        '<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "ls", "arguments": {"a": 1}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\na.txt\n</tool_response>\n"
        "<tool_response>\nb.txt\n</tool_response><|im_end|>\n"
        "<|im_start|>user\nand?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    plain = hf.apply_chat_template(messages[:2], tokenize=False)
    assert plain == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nlist<|im_end|>\n"


def test_cached_tokenizer_builds_once(tmp_path):
    first = bpe.cached_tokenizer(vocab_size=300, cache_dir=tmp_path)
    stamp = (first / "tokenizer.json").stat().st_mtime_ns
    assert bpe.cached_tokenizer(vocab_size=300, cache_dir=tmp_path) == first
    assert (first / "tokenizer.json").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no staging left behind
    assert len(AutoTokenizer.from_pretrained(str(first))) == 300


def test_too_small_a_vocabulary_is_refused():
    with pytest.raises(ValueError, match="vocab_size=200: expected at least 265"):
        bpe.train_tokenizer([], vocab_size=200)
