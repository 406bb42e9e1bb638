r"""Qwen3 0.6B to 8B (and Qwen2.5 7B) from a Hugging Face checkpoint on H200 or H100 GPUs.

Command (one host of 8 GPUs; the variant picks the model and the device, the checkpoint
is required; the GPU install first: pip install -e '.[gpu]', docs/gpus.md):
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.93 python -m gyrejax.launch \
      --config configs/qwen3_gpu.py:8b --workdir /data/runs/qwen3-8b \
      --config.model.hf_checkpoint=/models/Qwen3-8B
  Variants: 0.6b, 1.7b, 4b, 8b (Qwen/Qwen3-*), qwen25_7b (Qwen/Qwen2.5-7B-Instruct), sized
  for an H200 (141 GB); each with an H100 twin, `<variant>_h100` (80 GB).
  Without --config.model.hf_checkpoint it stops at once with one line naming the field;
  on JAX's CPU build (`cells.platform = "gpu"`) with one line naming the GPU install.
  JAX takes 75% of a GPU by default, less than the budgets below: the fraction 0.93 lets it
  use about 131 GB of an H200 (74 GB of an H100), above the 90% the layouts are sized to.
  The JAX engine shares that allocator with the trainer on every cell; for vLLM on GPU
  cells see docs/gpus.md (launch refuses the combinations that cannot start or wake).
  Several hosts: launch/slurm.sbatch.

What it does: loads the checkpoint (architecture from its config.json, weights in
bfloat16) onto the core cell, splits the devices into cells of `cells.size` GPUs (an
fsdp x tensor mesh each; 8 GPUs hold 8 / cells.size cells), greedily decodes
`generate.prompts`, then runs RL for `train.steps` steps like configs/tiny_cpu.py (no warm
start: the checkpoint is already trained): JAX engines on the rollout cells, the harness
running groups of `rl.group_size` mini_repo executions with agent code under bubblewrap
(`harness.sandbox = "bwrap"`: the run refuses to start without it), PPO on tree-packed
rows of `train.row_length` tokens, cells moved by the elastic policy. `model.tokenizer`
is the checkpoint directory: the built-in harness speaks its chat template, the agent's
tools as Qwen3 tool calls (gyrejax/harness/chat.py).
How long it takes: not measured yet (no GPU run of these variants so far); loading and
compiling take minutes, an RL step is as long as its slowest execution (bounded by
`harness.timeout_s`). It prints and writes what configs/tiny_cpu.py does.

The architecture fields are the HF config.json values of each checkpoint (Qwen3: vocab
151936, qk-norm, rope theta 1e6, tied embeddings up to 4B; Qwen2.5 7B: vocab 152064, q/k/v
bias, untied); load_hf reads them from the checkpoint and the run uses those, and
tests/test_gpu_configs.py checks that these equal what load_hf reads from the published
config.json. The layout rule (the same test checks it): every variant trains whole
32768-token rows (Qwen3's native context; `rollout.max_seq_len` equals it, so a call
trains in one row) on the smallest cell of at most 4 GPUs that holds them, with the
least recomputation that fits (`train.remat`: none, then matmuls, then layer) and the
loss head in chunks of 4096 positions (`train.loss_chunk_tokens`). An H200 variant then
spends what is left on a second row per device per micro-step where that still fits. The
engine's share (`rollout.gpu_memory_utilization`, at most 0.75) leaves the core cell room
for the trainer's state, and `rollout.max_slots` is what fits that share (at most 32).
The float32 master weights and moments are kept for the bfloat16 model
(`train.master_dtype`).

Memory per device, in GB (1e9 bytes), from gyrejax/memory.py on abstract shapes (its
docstring derives each term, and tests/test_memory.py holds it to XLA's own memory
analysis of the compiled micro-step; tests/test_gpu_configs.py renders every row below
from this file and checks it fits). A layout fits if its training peak is at most 90% of
its device (126.9 GB of an H200, 72.0 GB of an H100), the other 10% left for what the
estimate leaves out (CUDA context, NCCL buffers, XLA temporaries and fragmentation,
gathered layers).

Training, the core cell at its peak (one micro-step of train.rows_per_micro_step rows):
  * params: the weights micro-steps compute with, in bfloat16 (the masters cast down);
  * master: the float32 master weights the optimizer updates (train.master_dtype);
  * grads: one micro-step's gradients (bfloat16); accum: their float32 sum;
  * optim: AdamW's two moments, float32 like the masters, laid out like the parameters;
  * act/row: what every layer keeps for its backward, per row (remat none: each layer's
    activations, about 16 hidden + 12 intermediate + 12 q + 10 kv bytes per token; matmuls:
    the layer's input and its weight matmuls' outputs; layer: its input only);
  * head and layer: the two working sets on top, of which the larger counts: the loss
    head (a chunk's float32 logits and their cotangent, the float32 output matrix and its
    cotangent) and the layer whose backward runs (what remat recomputes, its attention's
    float32 dq, dk, dv);
  * rows: rows each device trains per micro-step; free: the share of the device the
    total leaves.
  variant        cell rows params master grads accum optim remat   act/row  head layer  total free
  0.6b           1x1     1    1.2    2.4   1.2   2.4   4.8 none       81.1   6.5   0.5   99.5  29%
  0.6b_h100      1x1     1    1.2    2.4   1.2   2.4   4.8 matmuls    22.5   6.5   2.7   41.0  49%
  1.7b           1x1     2    3.4    6.9   3.4   6.9  13.8 matmuls    37.6  13.5   7.7  123.1  13%
  1.7b_h100      1x1     1    3.4    6.9   3.4   6.9  13.8 layer       3.8   8.0   5.1   48.2  40%
  4b             1x1     2    8.0   16.1   8.0  16.1  32.2 layer       6.0  14.4  15.6  112.6  20%
  4b_h100        1x2     1    4.0    8.0   4.0   8.0  16.1 layer       6.0   4.7   4.5   56.3  30%
  8b             1x2     2    8.2   16.4   8.2  16.4  32.8 layer       9.7   9.6  11.4  114.7  19%
  8b_h100        1x4     1    4.1    8.2   4.1   8.2  16.4 layer       9.7   3.6   3.8   57.3  28%
  qwen25_7b      1x2     2    7.6   15.2   7.6  15.2  30.5 layer       6.6   9.0  12.2  106.6  24%
  qwen25_7b_h100 1x4     1    3.8    7.6   3.8   7.6  15.2 layer       6.6   3.3   3.9   53.3  33%

Rollout, an engine on one cell: KV/slot = layers x 2 x kv_heads x head_dim x
max_seq_len x 2 bytes for the whole model; per device over `tensor` (kv heads); KV =
slots x that; weights laid out by the rollout rules (tensor-parallel only); share =
rollout.gpu_memory_utilization x the device; max slots = the slots whose KV fits the share
beside the weights; core = the share plus the trainer's parameters, masters and optimizer
state, which stay on the core cell while it rolls out (at most the device).
  variant        KV/slot per device slots     KV weights  share max slots   core
  0.6b               3.8        3.8    27  101.5     1.2  105.8        27  114.1
  0.6b_h100          3.8        3.8    15   56.4     1.2   60.0        15   68.3
  1.7b               3.8        3.8    27  101.5     3.4  105.8        27  129.8
  1.7b_h100          3.8        3.8    12   45.1     3.4   52.0        12   76.1
  4b                 4.8        4.8    15   72.5     8.0   84.6        15  140.9
  4b_h100            4.8        2.4    18   43.5     4.0   48.0        18   76.2
  8b                 4.8        2.4    28   67.6     8.2   77.5        28  134.9
  8b_h100            4.8        1.2    32   38.7     4.1   48.0        36   76.7
  qwen25_7b          1.9        0.9    32   30.1     7.6   84.6        81  137.9
  qwen25_7b_h100     1.9        0.5    32   15.0     3.8   52.0       102   78.7

Why masters: bfloat16 keeps 8 significant bits, so an update below 0.2-0.4% of a weight
(half its step) rounds away; Adam's updates are about the learning rate (1e-6), weights
about 0.02, so without masters (train.master_dtype="same") most vanish. With them the
update lands on the float32 masters, and the bfloat16 weights the micro-steps and engines
use (the masters cast down) change once the masters cross a bfloat16 step.
"""

from typing import NamedTuple

from ml_collections import config_dict

from gyrejax.config import SAMPLE_SHARDING_RULES, TRAIN_SHARDING_RULES

# Architectures: the HF config.json values of each checkpoint, under our field names
# (hidden_size, intermediate_size, num_hidden_layers -> num_layers, num_attention_heads ->
# num_heads, num_key_value_heads -> num_kv_heads, head_dim, tie_word_embeddings).
_QWEN3 = dict(
    vocab_size=151936,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=40960,
    qk_norm=True,
    qkv_bias=False,
    o_bias=False,
)
_ARCHITECTURES = {
    "0.6b": dict(  # Qwen/Qwen3-0.6B
        _QWEN3,
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        tie_embeddings=True,
    ),
    "1.7b": dict(  # Qwen/Qwen3-1.7B
        _QWEN3,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        tie_embeddings=True,
    ),
    "4b": dict(  # Qwen/Qwen3-4B
        _QWEN3,
        hidden_size=2560,
        intermediate_size=9728,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        tie_embeddings=True,
    ),
    "8b": dict(  # Qwen/Qwen3-8B
        _QWEN3,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        tie_embeddings=False,
    ),
    "qwen25_7b": dict(  # Qwen/Qwen2.5-7B-Instruct (head_dim = hidden_size / heads)
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        head_dim=128,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        qk_norm=False,
        qkv_bias=True,
        o_bias=False,
        tie_embeddings=False,
    ),
}
# Bytes of each device a variant is sized for: an H200's "141 GB" and an H100's 80 GB
# (the device reports a little more of each). Plain numbers: config files load before
# JAX is imported.
DEVICES = {"h200": 141_000_000_000, "h100": 80_000_000_000}
ROW_LENGTH = 32768  # Qwen3's native context: every variant trains whole 32k-token rows
LOSS_CHUNK_TOKENS = 4096  # the head's logits 4096 positions at a time (never a whole row)


class Layout(NamedTuple):
    """How a variant uses its device (the rule in the docstring; tests/test_gpu_configs.py
    checks that no smaller cell or cheaper remat fits)."""

    fsdp: int
    tensor: int
    rows_per_device: int  # rows of ROW_LENGTH each device trains per micro-step
    remat: str  # train.remat
    gpu_memory_utilization: float  # the engine's share; the core also holds its trainer
    max_slots: int  # the engine's slots of ROW_LENGTH that fit that share


# Each H200 variant and its H100 twin (`<variant>_h100`).
_LAYOUTS = {
    "0.6b": Layout(1, 1, 1, "none", 0.75, 27),
    "0.6b_h100": Layout(1, 1, 1, "matmuls", 0.75, 15),
    "1.7b": Layout(1, 1, 2, "matmuls", 0.75, 27),
    "1.7b_h100": Layout(1, 1, 1, "layer", 0.65, 12),
    "4b": Layout(1, 1, 2, "layer", 0.6, 15),
    "4b_h100": Layout(1, 2, 1, "layer", 0.6, 18),
    "8b": Layout(1, 2, 2, "layer", 0.55, 28),
    "8b_h100": Layout(1, 4, 1, "layer", 0.6, 32),
    "qwen25_7b": Layout(1, 2, 2, "layer", 0.6, 32),
    "qwen25_7b_h100": Layout(1, 4, 1, "layer", 0.65, 32),
}
VARIANTS = tuple(_LAYOUTS)


def architecture(variant: str) -> str:
    """The checkpoint a variant trains (`8b_h100` -> `8b`)."""
    return variant.removesuffix("_h100")


def device(variant: str) -> str:
    """The device a variant is sized for: "h100" or "h200"."""
    return "h100" if variant.endswith("_h100") else "h200"


def get_config(variant: str | None = None) -> config_dict.ConfigDict:
    if variant not in _LAYOUTS:
        raise ValueError(
            f"configs/qwen3_gpu.py: variant {variant!r}; pick one of {', '.join(VARIANTS)} "
            "(e.g. --config configs/qwen3_gpu.py:8b)"
        )
    layout = _LAYOUTS[variant]
    fsdp, tensor, row_length = layout.fsdp, layout.tensor, ROW_LENGTH
    c = config_dict.ConfigDict()
    c.seed = 0
    # Compiled programs kept in <workdir>/jax_cache: running again (a resume) loads them
    # instead of compiling. A directory shares them between runs; "off" disables.
    c.compilation_cache_dir = "auto"

    # Devices and cells: the host's GPUs, in cells of fsdp x tensor.
    c.cells = config_dict.ConfigDict()
    c.cells.num_cpu_devices = 0  # real devices
    c.cells.size = fsdp * tensor
    c.cells.fsdp = fsdp
    c.cells.tensor = tensor
    c.cells.sequence = 1  # rows whole on each device (context parallelism: issue 18)
    c.cells.platform = "gpu"  # on the CPU install, launch names the GPU install and stops

    # Model: the checkpoint's architecture (load_hf takes it from config.json), bfloat16.
    c.model = config_dict.ConfigDict()
    for name, value in _ARCHITECTURES[architecture(variant)].items():
        c.model[name] = value
    c.model.dtype = "bfloat16"
    c.model.attention = "blocked"  # O(row x block) memory; the dense one is [row, row]
    c.model.attention_block_size = 512
    # Required: None until --config.model.hf_checkpoint=DIR sets it (from_dict says so).
    c.model.hf_checkpoint = config_dict.placeholder(str)
    # The checkpoint's own tokenizer by default. `.identity()` makes a reference of its
    # own: the shared one would make --config.model.tokenizer=DIR move the checkpoint too.
    c.model.tokenizer = c.model.get_ref("hf_checkpoint").identity()
    c.model.init_seed = 0

    # Rollout engines (a JAX engine on each rollout cell), as long as a row.
    c.rollout = config_dict.ConfigDict()
    c.rollout.engine = "jax"  # "vllm" (vLLM on each cell) is untested on GPUs
    c.rollout.max_slots = layout.max_slots  # concurrent executions per engine (the table)
    c.rollout.max_seq_len = row_length
    c.rollout.temperature = 1.0  # 0 is greedy: such calls are context, never trained
    c.rollout.top_p = 1.0  # the trainer takes log-probs under the same cut
    c.rollout.top_k = 0
    c.rollout.narrow = True  # decode only as wide as the busy slots (JAX engines)
    # The engine's share of a device; the core cell keeps the trainer's weights, masters
    # and moments beside it (the table's "core" column), which sets the share.
    c.rollout.gpu_memory_utilization = layout.gpu_memory_utilization
    c.rollout.sharding_rules = SAMPLE_SHARDING_RULES
    c.rollout.vllm_servers = ()
    c.rollout.engine_servers = ()

    # Training: one row per device per micro-step (rows split over fsdp).
    c.train = config_dict.ConfigDict()
    c.train.steps = 200
    c.train.executions_dir = ""
    c.train.learning_rate = 1e-6
    c.train.row_length = row_length
    c.train.rows_per_micro_step = fsdp * layout.rows_per_device
    c.train.row_lengths = ()  # row buckets: more compiled row lengths (none)
    c.train.max_row_shapes = 0  # most lengths per batch (0: no cap)
    c.train.max_grad_norm = 1.0
    c.train.weight_decay = 0.0
    c.train.master_dtype = "float32"  # float32 masters + moments for a bfloat16 model
    c.train.allow_low_precision_updates = False  # True: master_dtype "same" (not advised)
    c.train.remat = layout.remat  # none | matmuls | layer: the least recompute that fits
    c.train.loss_chunk_tokens = LOSS_CHUNK_TOKENS
    c.train.sharding_rules = TRAIN_SHARDING_RULES

    # RL objective and trajectory processing.
    c.rl = config_dict.ConfigDict()
    c.rl.loss = "ppo"
    c.rl.advantage = "grpo"
    c.rl.advantage_std = "unbiased"  # unbiased (ddof=1) | population: GRPO's group std
    c.rl.reward_shaping = "as_is"  # as_is | pass: 1 for every hidden check, else 0
    c.rl.clip_low = 0.2
    c.rl.clip_high = 0.28
    c.rl.tis_cap = 2.0
    c.rl.kl_coef = 0.0  # > 0 keeps a second copy of the weights (not in the tables)
    c.rl.kl_estimator = "k3"  # k1 | k2 | k3 (rl/losses.py: what each one's gradient follows)
    c.rl.clip_ratio_c = 3.0  # dual-clip: a negative advantage's loss is capped at 3 |A|
    c.rl.log_ratio_clamp = 20.0
    c.rl.group_size = 8
    c.rl.groups_per_step = 8
    c.rl.j_max = 5
    # Who acts: builtin (the harness) | command (your agent program through the run's
    # OpenAI door; see docs/byo-agent.md). The rest is for command only.
    c.rl.agent = "builtin"
    c.rl.agent_command = ""  # e.g. "python examples/agents/react_agent.py"
    c.rl.reward = "environment"  # environment (the verifier) | agent (its reward.json)
    c.rl.tasks_path = ""  # JSONL, a task a line ("id", "prompt"); "": the environment's

    # Harness: budgets that fill a context of rollout.max_seq_len (Config checks that the
    # context budget, two answers and an observation fit in it).
    c.harness = config_dict.ConfigDict()
    c.harness.environment = "mini_repo"
    c.harness.difficulty = 3
    c.harness.task_pool = 0
    c.harness.max_turns = 64
    c.harness.sub_agent_max_turns = 16
    c.harness.timeout_s = 1800.0
    c.harness.context_budget_tokens = row_length * 5 // 8
    c.harness.max_new_tokens = row_length // 8  # room for Qwen3's thinking
    c.harness.max_observation_tokens = row_length // 16
    c.harness.max_retries = 2
    c.harness.eval_retry_budget = 3
    c.harness.tool_latency_median_s = 0.0
    c.harness.tool_latency_sigma = 0.0
    c.harness.sandbox = "bwrap"  # agent code of a real model: a real boundary or no run
    c.harness.agent_sandbox = "bwrap"  # so is an agent command (rl.agent=command)
    c.harness.agent_max_processes = 512
    c.harness.agent_memory_bytes = 8 << 30
    c.harness.agent_file_bytes = 1 << 30
    c.harness.agent_tmp_bytes = 1 << 30
    c.harness.workspace_bytes = 1 << 30
    c.harness.workspace_inodes = 65536

    # No warm start: the checkpoint is trained already.
    c.warmup = config_dict.ConfigDict()
    c.warmup.steps = 0
    c.warmup.demonstrations = 64
    c.warmup.quality = 0.8
    c.warmup.delegation_prob = 0.2
    c.warmup.groups_per_step = 8
    c.warmup.learning_rate = 1e-5

    # Cell roles.
    c.scheduler = config_dict.ConfigDict()
    c.scheduler.policy = "elastic"
    c.scheduler.phi = 1
    c.scheduler.mu = 2
    c.scheduler.async_training_cells = 1.0  # a fraction alternates two whole splits
    c.scheduler.lookahead = "default"
    c.scheduler.cell_capacity = 0  # 0: rollout.max_slots
    c.scheduler.slot_occupancy = 0.0  # > 0: the capacity follows the time agents generate
    c.scheduler.elastic_overcommit = 0.0  # elastic: a share of a cell left short when behind
    c.scheduler.dispatch_order = "fifo"  # or "longest_first": by rl.tasks_path's "expected_s"
    c.scheduler.max_staleness = 3  # phi + mu
    c.scheduler.progress_every_s = 60.0

    # Checkpoints under --workdir (an HF export per checkpoint: vLLM and transformers
    # load it).
    c.checkpoint = config_dict.ConfigDict()
    c.checkpoint.every_steps = 10
    c.checkpoint.keep = 2
    c.checkpoint.export_hf = True

    # Smoke generations at launch: a check that the model decodes, not a meaningful prompt.
    c.generate = config_dict.ConfigDict()
    c.generate.prompts = ((1, 2, 3, 4),)
    c.generate.max_new_tokens = 16

    # Held-out evaluation (0: off): greedy and k sampled executions of tasks training
    # never draws, on the rollout engines at burst boundaries (eval.jsonl, eval.png).
    # Where metrics go besides the JSONL logs (always written): "tensorboard" (event files
    # in <workdir>/tensorboard; pip install -e '.[trackers]') and/or "wandb" (offline
    # unless WANDB_MODE says otherwise).
    c.logging = config_dict.ConfigDict()
    c.logging.writers = ("jsonl",)
    c.logging.wandb_project = "gyrejax"

    c.eval = config_dict.ConfigDict()
    c.eval.every_steps = 0
    c.eval.tasks_path = ""  # JSONL of environment tasks; "": a held-out split of its own
    c.eval.num_tasks = 32
    c.eval.seed = 1_000_003
    c.eval.samples_per_task = 4
    return c
