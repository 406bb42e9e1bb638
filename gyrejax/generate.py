"""Generate from an HF checkpoint with the KV-cache path.

  python -m gyrejax.generate --hf_checkpoint DIR --prompt_ids 1,2,3 --max_new_tokens 8 \
      [--temperature 0] [--seed 0] [--json] [--compilation_cache_dir DIR]

Prints the new token ids and their log-probs (under the sampling distribution; with
temperature 0, under the model's distribution). With --json: one JSON object with keys
`token_ids` and `logprobs`. A missing or malformed checkpoint gives one error line.
"""

from __future__ import annotations

import json
import sys

from absl import app, flags, logging

_CHECKPOINT = flags.DEFINE_string("hf_checkpoint", None, "HF checkpoint directory.")
_PROMPT = flags.DEFINE_string("prompt_ids", None, "Comma-separated prompt token ids.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 16, "Tokens to generate.", lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 is greedy.", lower_bound=0.0)
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object.")
_CACHE = flags.DEFINE_string(
    "compilation_cache_dir",
    "",
    "Directory of JAX's persistent compilation cache (a second call loads its programs); "
    "empty: none. $JAX_COMPILATION_CACHE_DIR wins (gyrejax/compilation_cache.py).",
)
flags.mark_flags_as_required(["hf_checkpoint", "prompt_ids"])


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        sys.exit(f"gyrejax.generate: --prompt_ids={text!r}: expected comma-separated integers")
    if not ids:
        sys.exit(f"gyrejax.generate: --prompt_ids={text!r}: expected at least one token id")
    return ids


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    prompt = _parse_ids(_PROMPT.value)

    from gyrejax import compilation_cache
    from gyrejax.config import ConfigError

    try:  # before anything compiles
        cache = compilation_cache.enable(_CACHE.value, None, field="--compilation_cache_dir")
    except ConfigError as e:
        sys.exit(f"gyrejax.generate: {e}")
    from gyrejax.model.hf_io import CheckpointError, load_hf
    from gyrejax.model.sampling import generate

    try:
        model = load_hf(_CHECKPOINT.value)
    except CheckpointError as e:
        sys.exit(f"gyrejax.generate: {e}")
    try:
        (result,) = generate(
            model,
            [prompt],
            max_new_tokens=_MAX_NEW.value,
            temperature=_TEMPERATURE.value,
            seed=_SEED.value,
        )
    except ValueError as e:
        sys.exit(f"gyrejax.{e}")
    if _JSON.value:
        print(json.dumps({"token_ids": result.token_ids, "logprobs": result.logprobs}))
    else:
        print("token_ids:", " ".join(map(str, result.token_ids)))
        print("logprobs: ", " ".join(f"{x:.6f}" for x in result.logprobs))
    if cache is not None:
        logging.info("%s", cache.describe())


if __name__ == "__main__":
    app.run(main)
