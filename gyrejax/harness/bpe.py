"""A small Qwen3-style HF tokenizer, trained here on the package's own source text.

Tests and the CPU demos need an HF tokenizer with a chat template without downloading
one, and it must load through `transformers.AutoTokenizer.from_pretrained(path)`, the
code path of a real Qwen3 tokenizer. `build_tokenizer(out_dir)` writes one:

  * a byte-level BPE trained with the `tokenizers` library on the gyrejax package's
    .py files (present in every install), pre-tokenized like Qwen2/Qwen3 (a regex split,
    then bytes mapped to printable characters), so any text and any bytes encode;
  * Qwen3's added tokens after the BPE vocabulary: the specials `<|endoftext|>`,
    `<|im_start|>`, `<|im_end|>` and the markup `<tool_call>`, `</tool_call>`,
    `<think>`, `</think>`, `<tool_response>`, `</tool_response>` (not special, as in
    Qwen3, so decoding keeps them);
  * `CHAT_TEMPLATE`, a Jinja template written for this project in Qwen3's layout:
    ChatML turns, the tools listed in the system turn, tool calls as
    `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` after the content,
    tool results as `<tool_response>` blocks inside a user turn (consecutive ones share
    it), and `<|im_start|>assistant\\n` as the generation prompt. Unlike Qwen3's own
    template it keeps an earlier turn's `<think>` block as written.

Training on about 1 MB of text takes a second or two; `cached_tokenizer` builds once per
vocabulary size and corpus under a cache directory.

Run `python -m gyrejax.harness.bpe OUT_DIR [--vocab_size N]` to write one.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import gyrejax

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MARKUP_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
    "<tool_response>",
    "</tool_response>",
)
EOS_TOKEN = "<|im_end|>"  # ends an assistant turn: the harness's stop token
PAD_TOKEN = "<|endoftext|>"

# Qwen2/Qwen3's pre-tokenizer split: contractions, letters with one leading non-letter,
# single digits, punctuation runs, newline runs, other whitespace.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Written for this project in Qwen3's format (see the module docstring).
CHAT_TEMPLATE = r"""
{%- macro text(content) -%}
  {%- if content is string -%}{{- content -}}
  {%- elif content -%}{%- for part in content -%}{{- part.text -}}{%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- set has_system = messages and messages[0].role == 'system' -%}
{%- if tools -%}
  {{- '<|im_start|>system\n' -}}
  {%- if has_system -%}{{- text(messages[0].content) + '\n\n' -}}{%- endif -%}
  {{- '# Tools\n\nThese functions are available; their signatures are inside ' -}}
  {{- '<tools></tools>, one JSON object per line:\n<tools>' -}}
  {%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
  {{- '\n</tools>\n\nTo call one, answer with a JSON object of its name and arguments ' -}}
  {{- 'inside <tool_call></tool_call> tags:\n<tool_call>\n' -}}
  {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif has_system -%}
  {{- '<|im_start|>system\n' + text(messages[0].content) + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
  {%- if loop.first and has_system -%}
  {%- elif message.role in ('user', 'system') -%}
    {{- '<|im_start|>' + message.role + '\n' + text(message.content) + '<|im_end|>\n' -}}
  {%- elif message.role == 'assistant' -%}
    {%- set content = text(message.content) -%}
    {{- '<|im_start|>assistant\n' + content -}}
    {%- for call in message.tool_calls or [] -%}
      {%- set function = call.function if call.function is defined else call -%}
      {%- if content or not loop.first -%}{{- '\n' -}}{%- endif -%}
      {{- '<tool_call>\n{"name": ' + (function.name | tojson) + ', "arguments": ' -}}
      {%- if function.arguments is string -%}{{- function.arguments -}}
      {%- else -%}{{- function.arguments | tojson -}}
      {%- endif -%}
      {{- '}\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\n' -}}
  {%- elif message.role == 'tool' -%}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
      {{- '<|im_start|>user' -}}
    {%- endif -%}
    {{- '\n<tool_response>\n' + text(message.content) + '\n</tool_response>' -}}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
      {{- '<|im_end|>\n' -}}
    {%- endif -%}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
""".strip()


def corpus_files(root: str | Path | None = None) -> list[Path]:
    """The text the tokenizer learns from: every .py file under `root` (default: the
    installed gyrejax package, so the corpus exists wherever gyrejax does), sorted."""
    root = Path(root) if root is not None else Path(gyrejax.__file__).parent
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def train_tokenizer(files: Sequence[str | Path], vocab_size: int = 1024):
    """A byte-level BPE `tokenizers.Tokenizer` over `files`, Qwen3's added tokens last.

    `vocab_size` counts everything (256 bytes, merges, added tokens); a small corpus may
    end with fewer merges, so the size to use is `get_vocab_size(with_added_tokens=True)`.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    added = len(SPECIAL_TOKENS) + len(MARKUP_TOKENS)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + added:
        raise ValueError(
            f"vocab_size={vocab_size}: expected at least {len(alphabet) + added} "
            "(256 bytes and the added tokens)"
        )
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - added, initial_alphabet=alphabet, show_progress=False
    )
    core.train_from_iterator(_texts(files), trainer=trainer)
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return core


def build_tokenizer(
    out_dir: str | Path, vocab_size: int = 1024, files: Sequence[str | Path] | None = None
) -> Path:
    """Trains the tokenizer (see module docstring) and saves it as an HF tokenizer
    directory (tokenizer.json, tokenizer_config.json, the chat template); returns it.

    Args:
      out_dir: created if missing.
      vocab_size: the total vocabulary (a tiny model's `model.vocab_size` must cover
        `len(AutoTokenizer.from_pretrained(out_dir))`).
      files: the training text; default `corpus_files()`.
    """
    from transformers import PreTrainedTokenizerFast

    core = train_tokenizer(corpus_files() if files is None else files, vocab_size)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=1 << 20,
    )
    hf.chat_template = CHAT_TEMPLATE
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out_dir))
    return out_dir


def cached_tokenizer(vocab_size: int = 1024, cache_dir: str | Path | None = None) -> Path:
    """`build_tokenizer` once per vocabulary size, corpus and template: the directory is
    keyed by their hash under `cache_dir` (default: `$GYREJAX_CACHE` or the system temp
    directory) and written atomically (built aside, then renamed), so concurrent callers
    and a build cut short never leave a half-written tokenizer in place."""
    files = corpus_files()
    digest = hashlib.sha256(f"{vocab_size}\n{CHAT_TEMPLATE}\n{SPLIT_PATTERN}".encode())
    for text in _texts(files):
        digest.update(text.encode("utf-8", "surrogatepass"))
    root = Path(cache_dir or os.environ.get("GYREJAX_CACHE") or tempfile.gettempdir())
    path = root / f"gyrejax-bpe-{vocab_size}-{digest.hexdigest()[:16]}"
    if (path / "tokenizer.json").is_file():
        return path
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=root))
    try:
        build_tokenizer(staging, vocab_size, files)
        staging.rename(path)
    except OSError:
        if not (path / "tokenizer.json").is_file():
            raise
        # another caller renamed its build into place first
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def _texts(files: Iterable[str | Path]) -> Iterable[str]:
    for path in files:
        yield Path(path).read_text(encoding="utf-8", errors="replace")


def main(argv: Sequence[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--vocab_size", type=int, default=1024)
    args = parser.parse_args(argv)
    path = build_tokenizer(args.out_dir, args.vocab_size)
    print(path)


if __name__ == "__main__":
    main()
