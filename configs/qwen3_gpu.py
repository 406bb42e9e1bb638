r"""Qwen3 0.6B to 8B (and Qwen2.5 7B) from a Hugging Face checkpoint on H200 GPUs.

Command (one host of 8 H200s; the variant picks the model, the checkpoint is required):
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.93 python -m gyrejax.launch \
      --config configs/qwen3_gpu.py:8b --workdir /data/runs/qwen3-8b \
      --config.model.hf_checkpoint=/models/Qwen3-8B
  Variants: 0.6b, 1.7b, 4b, 8b (Qwen/Qwen3-*), qwen25_7b (Qwen/Qwen2.5-7B-Instruct).
  Without --config.model.hf_checkpoint it stops at once with one line naming the field.
  JAX takes 75% of a GPU by default, less than the budgets below: the fraction 0.93 lets it
  use about 140 GB of an H200's 143771 MiB. Several hosts: launch/slurm.sbatch.

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
config.json. Each variant trains the longest row, 32768 (Qwen3's native context) else
16384, on the smallest cell of at most 4 GPUs (so one host runs a core and a satellite)
that holds it within the budget below, with the float32 master weights and moments the
trainer keeps for a bfloat16 model (`train.master_dtype`); `rollout.max_seq_len` equals
the row length (a call trains in one row).

Memory per device, in GB (1e9 bytes), from gyrejax/memory.py on abstract shapes (its
docstring derives each term; tests/test_gpu_configs.py renders every row below from this
file and checks it fits). Budget: DEVICE_MEMORY_BYTES, an H200's 141 GB; a layout fits
if its training peak is at most 90% of that (126.9 GB), the other 10% left for what the
estimate leaves out (CUDA context, NCCL buffers, XLA temporaries and fragmentation,
gathered layers).

Training, the core cell at its peak (one micro-step of train.rows_per_micro_step rows,
one row per device):
  * params: the weights micro-steps compute with, in bfloat16 (the masters cast down);
  * master: the float32 master weights the optimizer updates (train.master_dtype);
  * grads: one micro-step's gradients (bfloat16); accum: their float32 sum;
  * optim: AdamW's two moments, float32 like the masters, laid out like the parameters;
  * act/row: row_length x (layers + 1) x what a layer keeps for its backward per token
    (16 hidden + 12 intermediate + 12 q + 10 kv bytes and a few per head with qk-norm;
    Qwen2.5: 6 q and 4 kv; the extra layer is the working set of the layer in backward);
  * logits: 3 float32 copies of row_length x vocab (rl/objective.py computes logits at
    every position, not only trained ones: logits, the kept exp, their cotangent), over
    `tensor`, plus the float32 output matrix and its cotangent;
  * headroom: 141 GB less the total. Masters and float32 moments cost 8 bytes per
    parameter more than bfloat16 weights and moments alone (train.master_dtype="same"),
    which would lose most updates (below).
  variant    cell    row params master grads accum optim act/row logits  total   headroom
  0.6b       1x2   32768    0.6    1.2   0.6   1.2   2.4    50.7   30.8   87.5   53.5 38%
  1.7b       1x4   32768    0.9    1.7   0.9   1.7   3.4    58.0   16.2   82.8   58.2 41%
  4b         1x4   16384    2.0    4.0   2.0   4.0   8.0    52.2    8.7   81.0   60.0 43%
  8b         1x4   16384    4.1    8.2   4.1   8.2  16.4    71.8    9.4  122.1   18.9 13%
  qwen25_7b  1x4   16384    3.8    7.6   3.8   7.6  15.2    57.6    9.2  104.8   36.2 26%

Rollout, an engine on one cell: KV/slot = layers x 2 x kv_heads x head_dim x
max_seq_len x 2 bytes for the whole model; per device over `tensor` (kv heads); KV =
slots x that; weights laid out by the rollout rules (tensor-parallel only); share =
rollout.gpu_memory_utilization x 141 GB; max slots = the slots whose KV fits the share
beside the weights; core = the share plus the trainer's parameters, masters and optimizer
state, which stay on the core cell while it rolls out (at most 141 GB: the share is 0.75,
since at 0.85 the 8b and qwen25_7b cores would need 148.5 and 146.5 GB).
  variant    KV/slot per device slots     KV weights  share max slots   core
  0.6b           3.8        1.9    32   60.1     0.6  105.8        55  109.9
  1.7b           3.8        0.9    32   30.1     0.9  105.8       111  111.8
  4b             2.4        0.6    32   19.3     2.0  105.8       171  119.8
  8b             2.4        0.6    32   19.3     4.1  105.8       168  134.4
  qwen25_7b      0.9        0.2    32    7.5     3.8  105.8       434  132.4

Why masters: bfloat16 keeps 8 significant bits, so an update below 0.2-0.4% of a weight
(half its step) rounds away; Adam's updates are about the learning rate (1e-6), weights
about 0.02, so without masters (train.master_dtype="same") most vanish. With them the
update lands on the float32 masters, and the bfloat16 weights the micro-steps and engines
use (the masters cast down) change once the masters cross a bfloat16 step.

Known limits, from the trainer as it is:
  * No rematerialisation and full-vocabulary logits at every position: a row's
    activations dominate, which is why 4b, 8b and qwen25_7b train 16384-token rows on 4
    GPUs (32768 would need 8 GPUs for 4b and does not fit 8 for 8b or qwen25_7b).
"""

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
# Cell shape (fsdp, tensor) and row length per variant, by the rule in the docstring
# (tests/test_gpu_configs.py checks that the next smaller cell and the longer row do not
# fit). Tensor parallelism, not fsdp, shrinks a row's activations (fsdp only splits the
# rows of a micro-step), so the cells grow along `tensor`.
_LAYOUTS = {
    "0.6b": ((1, 2), 32768),
    "1.7b": ((1, 4), 32768),
    "4b": ((1, 4), 16384),
    "8b": ((1, 4), 16384),
    "qwen25_7b": ((1, 4), 16384),
}
VARIANTS = tuple(_ARCHITECTURES)
# The device every variant is sized for, an H200 (bytes): tests/test_gpu_configs.py checks
# each layout against it. A plain number: config files load before JAX is imported.
DEVICE_MEMORY_BYTES = 141_000_000_000


def get_config(variant: str | None = None) -> config_dict.ConfigDict:
    if variant not in _ARCHITECTURES:
        raise ValueError(
            f"configs/qwen3_gpu.py: variant {variant!r}; pick one of {', '.join(VARIANTS)} "
            "(e.g. --config configs/qwen3_gpu.py:8b)"
        )
    (fsdp, tensor), row_length = _LAYOUTS[variant]
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

    # Model: the checkpoint's architecture (load_hf takes it from config.json), bfloat16.
    c.model = config_dict.ConfigDict()
    for name, value in _ARCHITECTURES[variant].items():
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
    c.rollout.max_slots = 32  # concurrent executions per engine; the table says how many fit
    c.rollout.max_seq_len = row_length
    c.rollout.temperature = 1.0
    c.rollout.narrow = True  # decode only as wide as the busy slots (JAX engines)
    # vLLM's share of a device; the core cell keeps the trainer's state beside it (with
    # float32 masters and moments 28.7 GB for 8b: 0.85 would exceed the device).
    c.rollout.gpu_memory_utilization = 0.75
    c.rollout.sharding_rules = SAMPLE_SHARDING_RULES
    c.rollout.vllm_servers = ()
    c.rollout.engine_servers = ()

    # Training: one row per device per micro-step (rows split over fsdp).
    c.train = config_dict.ConfigDict()
    c.train.steps = 200
    c.train.executions_dir = ""
    c.train.learning_rate = 1e-6
    c.train.row_length = row_length
    c.train.rows_per_micro_step = fsdp
    c.train.row_lengths = ()  # row buckets: more compiled row lengths (none)
    c.train.max_row_shapes = 0  # most lengths per batch (0: no cap)
    c.train.max_grad_norm = 1.0
    c.train.weight_decay = 0.0
    c.train.master_dtype = "float32"  # float32 masters + moments for a bfloat16 model
    c.train.sharding_rules = TRAIN_SHARDING_RULES

    # RL objective and trajectory processing.
    c.rl = config_dict.ConfigDict()
    c.rl.loss = "ppo"
    c.rl.advantage = "grpo"
    c.rl.clip_low = 0.2
    c.rl.clip_high = 0.28
    c.rl.tis_cap = 2.0
    c.rl.kl_coef = 0.0  # > 0 keeps a second copy of the weights (not in the tables)
    c.rl.group_size = 8
    c.rl.groups_per_step = 8
    c.rl.j_max = 5
    # Who acts: builtin (the harness) | command (your agent program through the run's
    # OpenAI door; see README "Bring your own agent"). The rest is for command only.
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
    return c
