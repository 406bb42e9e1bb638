r"""Tiny model on 8 CPU-emulated devices in 4 cells: the embedded default.

Command:
  python -m gyrejax.launch --config configs/tiny_cpu.py --workdir /tmp/gyrejax-tiny

What it does (at this stage of the project): emulates 8 CPU devices, splits them into
4 cells of 2 (a 2x1 fsdp x tensor mesh each; cell 0 is the core), builds a ~1M-parameter
Qwen3-style model on the core cell, logs the layout, and greedily decodes the prompts in
`generate.prompts` with the KV cache. Takes about 20 s on 2 cores.

It prints (absl log lines) the cells, the parameter count and one line per greedy
generation, and writes `layout.json` and `generations.jsonl` into --workdir.

Variants:
  configs/tiny_cpu.py:smoke   two layers, short generations; for tests (~10 s).
"""

from ml_collections import config_dict

from gyrejax.config import SAMPLE_SHARDING_RULES, TRAIN_SHARDING_RULES


def get_config(variant: str | None = None) -> config_dict.ConfigDict:
    c = config_dict.ConfigDict()
    c.seed = 0

    # Devices and cells: 8 emulated CPU devices -> 4 cells of 2.
    c.cells = config_dict.ConfigDict()
    c.cells.num_cpu_devices = 8
    c.cells.size = 2
    c.cells.fsdp = 2
    c.cells.tensor = 1

    # Model: Qwen3-style (q/k norm, tied embeddings). head_dim 64 is the smallest that
    # vLLM's CPU attention serves.
    c.model = config_dict.ConfigDict()
    c.model.vocab_size = 512
    c.model.hidden_size = 128
    c.model.intermediate_size = 384
    c.model.num_layers = 4
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.head_dim = 64
    c.model.rope_theta = 10_000.0
    c.model.rms_norm_eps = 1e-6
    c.model.max_position_embeddings = 32768
    c.model.qk_norm = True
    c.model.qkv_bias = False
    c.model.o_bias = False
    c.model.tie_embeddings = True
    c.model.dtype = "float32"
    c.model.attention = "dense"
    c.model.attention_block_size = 256
    c.model.hf_checkpoint = ""  # set to an HF directory to start from trained weights
    c.model.init_seed = 0

    # Rollout engines (JAX engine on each rollout cell).
    c.rollout = config_dict.ConfigDict()
    c.rollout.engine = "jax"
    c.rollout.max_slots = 8
    c.rollout.max_seq_len = 2048
    c.rollout.temperature = 1.0
    c.rollout.sharding_rules = SAMPLE_SHARDING_RULES

    # Training. With executions_dir set, launch trains on that execution store (SFT or
    # RL by rl.loss) on every cell, checkpointing into --workdir and resuming from it.
    c.train = config_dict.ConfigDict()
    c.train.steps = 8
    c.train.executions_dir = ""
    c.train.learning_rate = 1e-4
    c.train.row_length = 2048
    c.train.rows_per_micro_step = 1
    c.train.max_grad_norm = 1.0
    c.train.weight_decay = 0.0
    c.train.sharding_rules = TRAIN_SHARDING_RULES

    # RL objective and trajectory processing.
    c.rl = config_dict.ConfigDict()
    c.rl.loss = "ppo"  # ppo | grpo | tis | sft
    c.rl.advantage = "grpo"  # grpo | mean_centered | rloo
    c.rl.clip_low = 0.2
    c.rl.clip_high = 0.28
    c.rl.tis_cap = 2.0
    c.rl.kl_coef = 0.0
    c.rl.group_size = 4
    c.rl.groups_per_step = 2
    c.rl.j_max = 5

    # Harness and environment.
    c.harness = config_dict.ConfigDict()
    c.harness.environment = "mini_repo"
    c.harness.max_turns = 32
    c.harness.timeout_s = 120.0
    c.harness.context_budget_tokens = 1536

    # Cell roles.
    c.scheduler = config_dict.ConfigDict()
    c.scheduler.policy = "elastic"
    c.scheduler.phi = 1
    c.scheduler.mu = 1

    # Checkpoints under --workdir.
    c.checkpoint = config_dict.ConfigDict()
    c.checkpoint.every_steps = 4
    c.checkpoint.keep = 2
    c.checkpoint.export_hf = True

    # Smoke generations run at launch.
    c.generate = config_dict.ConfigDict()
    c.generate.prompts = ((1, 2, 3, 4), (10, 20, 30))
    c.generate.max_new_tokens = 16

    if variant == "smoke":
        c.model.num_layers = 2
        c.generate.max_new_tokens = 4
    elif variant is not None:
        raise ValueError(f"configs/tiny_cpu.py: unknown variant {variant!r}; known: smoke")
    return c
