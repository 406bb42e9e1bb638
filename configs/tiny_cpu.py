r"""Tiny model on 8 CPU-emulated devices in 4 cells: the embedded default, end to end.

Command:
  python -m gyrejax.launch --config configs/tiny_cpu.py --workdir /tmp/gyrejax-tiny
  (add --config.scheduler.policy=colocate|async|elastic to compare the policies)

What it does: emulates 8 CPU devices, splits them into 4 cells of 2 (a 2x1 fsdp x tensor
mesh each; cell 0 is the core), builds a ~0.2M-parameter Qwen3-style model over the byte
tokenizer (vocab 264) on the core cell, logs the layout, greedily decodes
`generate.prompts`, then:
  1. warm start: records `warmup.demonstrations` demonstrations of mini_repo tasks through
     the harness and trains on them with SFT for `warmup.steps` steps on all 4 cells;
  2. RL for `train.steps` steps: JAX engines on the rollout cells behind the proxy, the
     harness running groups of `rl.group_size` executions, PPO on tree-packed batches,
     cells moved between rollout and training by `scheduler.policy` (elastic).
     With `--config.train.steps=0`, one rollout batch instead (mean reward reported).
Takes about 10 minutes on 2 cores (warm start about 6, RL about 4); running it again
resumes (finished stages are skipped, RL continues from its last checkpoint).

It prints (absl log lines) the cells, the parameter count, the SFT steps, then a progress
line every `scheduler.progress_every_s` seconds, one line per RL step (reward, loss,
tokens, staleness, training cells, roles) and per transition (phases timed). --workdir
gets `layout.json`, `generations.jsonl`, `demonstrations/`, `warmup/`, `executions/`,
`metrics.jsonl`, `transitions.jsonl`, `dispatch.jsonl`, `checkpoints/`,
`cell_roles.png`, `steps.png`, `run_summary.json` (first vs last reward, utilisation,
transitions) and `jax_cache/` (compiled programs: running again loads them, so a resume
starts in seconds).

What it learns: on its own 16-task pool the reward rises, but the warm start recalls
that pool rather than solving tasks: on unseen tasks held-out pass@1 (every hidden
check) is 0 before and after RL. The `learning` variant is the demo that learns.

Variants:
  configs/tiny_cpu.py:smoke   one layer, few short turns, no warm start, 2 RL steps; for
                              tests.
  configs/tiny_cpu.py:learning  RL that helps on unseen tasks: a warm start on fresh
                              tasks (task_pool 0, 8192 demonstrations, 1000 SFT steps:
                              about 18 minutes on 2 cores), 80 RL steps, 64 held-out
                              tasks evaluated at steps 40 and 80. benchmarks/
                              learning_bench.py, 3 seeds, held-out sampled pass@1 at
                              step 80 (mean +- 95% interval): RL 0.328 +- 0.026, the
                              same runs at lr 0 0.210 +- 0.017; sampled reward 0.783 +-
                              0.004 against 0.655 +- 0.024 (docs/trajectory-trees.md).
  configs/tiny_cpu.py:agent   bring your own everything on CPU: the example external
                              agent (examples/agents/react_agent.py) through the run's
                              OpenAI door on the mini-repo task file, the small BPE
                              tokenizer (built once into a cache directory: $GYREJAX_CACHE
                              or the temp directory; nothing downloads) and a tiny Qwen3
                              over its 1024 ids; a warm start on demonstrations
                              recorded through that agent (see `_agent`), 6 RL steps.
                              Under 10 minutes on 2 cores; N/U of its trees ~2.7 (the
                              shared tools prompt).
"""

import shlex
import sys
from pathlib import Path

from ml_collections import config_dict

from gyrejax.config import SAMPLE_SHARDING_RULES, TRAIN_SHARDING_RULES
from gyrejax.harness.tokenizer import VOCAB_SIZE


def get_config(variant: str | None = None) -> config_dict.ConfigDict:
    c = config_dict.ConfigDict()
    c.seed = 0
    # Compiled programs kept in <workdir>/jax_cache: running again (a resume) loads them
    # instead of compiling. A directory shares them between runs; "off" disables.
    c.compilation_cache_dir = "auto"

    # Devices and cells: 8 emulated CPU devices -> 4 cells of 2.
    c.cells = config_dict.ConfigDict()
    c.cells.num_cpu_devices = 8
    c.cells.size = 2
    c.cells.fsdp = 2
    c.cells.tensor = 1
    c.cells.sequence = 1  # > 1: rows split over a `sequence` axis (context parallelism)
    c.cells.platform = "any"  # whatever JAX sees ("gpu": refuse a CPU-only JAX)

    # Model: Qwen3-style (q/k norm, tied embeddings), ~0.3M parameters: small enough to
    # learn the task pool in a few CPU minutes. head_dim 64 (vLLM's CPU attention needs it).
    c.model = config_dict.ConfigDict()
    c.model.vocab_size = VOCAB_SIZE  # the harness's byte tokenizer
    c.model.hidden_size = 64
    c.model.intermediate_size = 192
    c.model.num_layers = 2
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
    c.model.attention = "blocked"
    c.model.attention_block_size = 256
    c.model.hf_checkpoint = ""  # set to an HF directory to start from trained weights
    c.model.tokenizer = "bytes"  # or an HF tokenizer directory (python -m gyrejax.harness.bpe DIR)
    c.model.init_seed = 0

    # Rollout engines (JAX engine on each rollout cell).
    c.rollout = config_dict.ConfigDict()
    c.rollout.engine = "jax"  # or "vllm": vLLM in-process on each cell (pip install -e '.[vllm]')
    c.rollout.max_slots = 16
    c.rollout.max_seq_len = 640
    c.rollout.temperature = 1.0  # 0 is greedy: such calls are context, never trained
    c.rollout.top_p = 1.0  # the trainer takes log-probs under the same cut
    c.rollout.top_k = 0
    c.rollout.narrow = True  # decode only as wide as the busy slots (JAX engines)
    c.rollout.gpu_memory_utilization = 0.9  # a vLLM engine's share of a GPU; unused on CPU
    c.rollout.sharding_rules = SAMPLE_SHARDING_RULES
    # Engines outside the cells, by URL (vLLM servers, gyrejax engine servers); they
    # rejoin each published version from an HF export under --workdir.
    c.rollout.vllm_servers = ()
    c.rollout.engine_servers = ()

    # Training. With executions_dir set, launch trains on that execution store (SFT or
    # RL by rl.loss) on every cell, checkpointing into --workdir and resuming from it.
    c.train = config_dict.ConfigDict()
    c.train.steps = 40  # RL steps after the warm start
    c.train.executions_dir = ""
    c.train.learning_rate = 3e-4  # RL (the warm start has its own)
    c.train.row_length = 640
    c.train.rows_per_micro_step = 4
    c.train.row_lengths = ()  # row buckets: more compiled row lengths (none)
    c.train.max_row_shapes = 0  # most lengths per batch (0: no cap)
    c.train.max_grad_norm = 1.0
    c.train.weight_decay = 0.0
    c.train.master_dtype = "float32"  # masters beside a bfloat16 model (none: float32 here)
    c.train.allow_low_precision_updates = False  # True: master_dtype "same" on bfloat16
    c.train.remat = "none"  # none | matmuls | layer: what a layer keeps for its backward
    c.train.loss_chunk_tokens = 0  # > 0: the loss head over chunks of positions
    c.train.sharding_rules = TRAIN_SHARDING_RULES

    # RL objective and trajectory processing.
    c.rl = config_dict.ConfigDict()
    c.rl.loss = "ppo"  # ppo | grpo | tis | sft
    c.rl.advantage = "grpo"  # grpo | mean_centered | rloo
    c.rl.advantage_std = "unbiased"  # unbiased (ddof=1) | population: GRPO's group std
    c.rl.reward_shaping = "as_is"  # as_is | pass: 1 for every hidden check, else 0
    c.rl.clip_low = 0.2
    c.rl.clip_high = 0.28
    c.rl.tis_cap = 2.0
    c.rl.kl_coef = 0.0
    c.rl.kl_estimator = "k3"  # k1 | k2 | k3 (rl/losses.py: what each one's gradient follows)
    c.rl.clip_ratio_c = 3.0  # dual-clip: a negative advantage's loss is capped at 3 |A|
    c.rl.log_ratio_clamp = 20.0
    c.rl.group_size = 4
    c.rl.groups_per_step = 4
    c.rl.j_max = 5
    # Who acts: builtin (the harness) | command (your agent program through the run's
    # OpenAI door; see docs/byo-agent.md). The rest is for command only.
    c.rl.agent = "builtin"
    c.rl.agent_command = ""  # e.g. "python examples/agents/react_agent.py"
    c.rl.reward = "environment"  # environment (the verifier) | agent (its reward.json)
    c.rl.tasks_path = ""  # JSONL, a task a line ("id", "prompt"); "": the environment's

    # Harness and environment (mini_repo: write the files a short spec describes).
    c.harness = config_dict.ConfigDict()
    c.harness.environment = "mini_repo"
    c.harness.difficulty = 1
    c.harness.task_pool = 16  # a pool the tiny model can learn within a CPU budget
    c.harness.max_turns = 6
    c.harness.sub_agent_max_turns = 3
    c.harness.timeout_s = 120.0
    c.harness.context_budget_tokens = 320
    c.harness.max_new_tokens = 48
    c.harness.max_observation_tokens = 128
    c.harness.max_retries = 1
    c.harness.eval_retry_budget = 3
    # Wall time of each tool call (lognormal; 0: none). The latency-bound regime of
    # benchmarks/schedule_bench.py --real sets a median of 2 s.
    c.harness.tool_latency_median_s = 0.0
    c.harness.tool_latency_sigma = 0.0
    # Agent code runs under bubblewrap when it works here, else under the Python guard
    # (not a security boundary; the log and run_summary.json say so). "bwrap" insists.
    c.harness.sandbox = "auto"
    # An agent command (rl.agent=command) runs in a sandbox of its own: PID and network
    # namespaces, the door its one way out, the workdir hidden ("none": trusted agents
    # only, said in run_summary.json). Its tree's processes and memory (cgroups, where the
    # run is root; the memory also bounds each process's address space), its file size
    # and its private /tmp's size:
    c.harness.agent_sandbox = "bwrap"
    c.harness.agent_max_processes = 512
    c.harness.agent_memory_bytes = 4 << 30
    c.harness.agent_file_bytes = 256 << 20
    c.harness.agent_tmp_bytes = 256 << 20
    # Each workspace's bytes and inodes, whoever writes them (a tmpfs per workspace when
    # the run is root; run_summary.json says whether they are enforced).
    c.harness.workspace_bytes = 64 << 20
    c.harness.workspace_inodes = 4096

    # Supervised warm start on demonstrations.
    c.warmup = config_dict.ConfigDict()
    c.warmup.steps = 80
    c.warmup.demonstrations = 2560
    c.warmup.quality = 0.8
    c.warmup.delegation_prob = 0.1
    c.warmup.groups_per_step = 32
    c.warmup.learning_rate = 3e-3

    # Cell roles.
    c.scheduler = config_dict.ConfigDict()
    c.scheduler.policy = "elastic"
    c.scheduler.phi = 1
    c.scheduler.mu = 2  # bursts of two steps: long enough for cells to leave and return
    c.scheduler.async_training_cells = 2.0  # a fraction (1.5) alternates 1 and 2 cells
    c.scheduler.lookahead = "default"  # elastic "gate", async "phi"; or either for both
    c.scheduler.cell_capacity = 0  # executions a rollout cell counts (0: rollout.max_slots)
    c.scheduler.slot_occupancy = 0.0  # > 0: the capacity follows the time agents generate
    c.scheduler.elastic_overcommit = 0.0  # elastic: a share of a cell left short when behind
    c.scheduler.dispatch_order = "fifo"  # or "longest_first": by rl.tasks_path's "expected_s"
    c.scheduler.max_staleness = 3  # phi + mu: every policy trains within the same bound
    c.scheduler.progress_every_s = 10.0

    # Checkpoints under --workdir.
    c.checkpoint = config_dict.ConfigDict()
    c.checkpoint.every_steps = 4
    c.checkpoint.keep = 2
    c.checkpoint.export_hf = True

    # Smoke generations run at launch.
    c.generate = config_dict.ConfigDict()
    c.generate.prompts = ((1, 2, 3, 4), (10, 20, 30))
    c.generate.max_new_tokens = 16

    # Held-out evaluation (0: off): every `every_steps` steps, at a burst boundary, each
    # held-out task once greedily and `samples_per_task` times sampled, on the rollout
    # engines while training goes on, never trained -> eval.jsonl, eval.png.
    # Where metrics go besides the JSONL logs (always written): "tensorboard" (event files
    # in <workdir>/tensorboard; pip install -e '.[trackers]') and/or "wandb" (offline
    # unless WANDB_MODE says otherwise).
    c.logging = config_dict.ConfigDict()
    c.logging.writers = ("jsonl",)
    c.logging.wandb_project = "gyrejax"

    c.eval = config_dict.ConfigDict()
    c.eval.every_steps = 0
    c.eval.tasks_path = ""  # JSONL of environment tasks; "": a held-out split of its own
    c.eval.num_tasks = 8  # the split: tasks none of training's draws can give
    c.eval.seed = 1_000_003  # the split's draw
    c.eval.samples_per_task = 4  # k of pass@k

    if variant == "smoke":
        c.model.num_layers = 1
        c.generate.max_new_tokens = 4
        c.warmup.steps = 0
        c.rl.groups_per_step = 1
        c.rl.group_size = 2
        c.train.steps = 2
        c.scheduler.mu = 1  # a burst per step: every policy switches within 2 steps
        c.scheduler.max_staleness = 2
        c.checkpoint.every_steps = 1
        c.harness.max_turns = 2
        c.harness.max_new_tokens = 16
        c.harness.max_retries = 0
    elif variant == "agent":
        _agent(c)
    elif variant == "learning":
        _learning(c)
    elif variant is not None:
        raise ValueError(
            f"configs/tiny_cpu.py: unknown variant {variant!r}; known: smoke, agent, learning"
        )
    return c


REPO = Path(__file__).resolve().parent.parent
BPE_VOCAB_SIZE = 1024  # the tokenizer's whole vocabulary, added tokens included


def _learning(c: config_dict.ConfigDict) -> None:
    """The `learning` variant (module docstring), in place: a warm start that generalises
    and RL evaluated on held-out tasks, as benchmarks/learning_bench.py runs it."""
    # The main job's 16-task pool is memorised by its warm start, which then scores about
    # 0.01 on any other task: here every demonstration and every RL task is a fresh draw.
    c.harness.task_pool = 0
    c.warmup.demonstrations = 8192
    c.warmup.steps = 1000
    c.train.steps = 80
    c.eval.every_steps = 40  # the middle and the end; lr 0 (the control) is the start
    c.eval.num_tasks = 64  # 256 sampled executions: pass@1's sampling error about 0.03
    c.eval.samples_per_task = 4


def _agent(c: config_dict.ConfigDict) -> None:
    """The `agent` variant (module docstring), in place.

    Warm start: 128 demonstrations recorded by the agent itself, driven by the
    environment's demonstrator through a door (`command_demonstrations`), so they speak
    its prompt and tools; 100 SFT steps of 8. A random tiny model never writes a valid
    tool call; after them it sometimes does, and RL starts from a reward above 0.
    """
    from gyrejax.harness.bpe import cached_tokenizer  # tokenizers, only for this variant

    c.model.tokenizer = str(cached_tokenizer(BPE_VOCAB_SIZE))
    c.model.vocab_size = BPE_VOCAB_SIZE
    # The chat template's tools block is ~850 tokens: rows hold it plus three short turns.
    c.rollout.max_seq_len = 1600
    c.train.row_length = 1600
    c.harness.context_budget_tokens = 1300
    c.harness.max_new_tokens = 48  # the door's max_tokens when a request gives none
    c.harness.timeout_s = 120.0
    c.rl.agent = "command"
    # The agent runs in its workspace: absolute paths. Its own knobs (env variables):
    # three turns of 48 tokens keep its growing conversation within max_seq_len.
    script = REPO / "examples" / "agents" / "react_agent.py"
    c.rl.agent_command = shlex.join(
        ["env", "AGENT_MAX_TURNS=3", "AGENT_MAX_TOKENS=48", sys.executable, str(script)]
    )
    c.rl.tasks_path = str(REPO / "examples" / "agents" / "mini_repo_tasks.jsonl")
    c.rl.reward = "environment"
    c.rl.group_size = 4
    c.rl.groups_per_step = 2
    # Warm start in the agent's own format: the environment's demonstrations drive
    # react_agent.py through a door (harness/demonstrations.py:command_demonstrations).
    c.warmup.demonstrations = 128
    c.warmup.steps = 100
    c.warmup.groups_per_step = 8
    c.warmup.learning_rate = 5e-3
    c.train.steps = 6
    c.checkpoint.every_steps = 2
