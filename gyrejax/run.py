"""`run(config, workdir)`: the main job, called by `gyrejax.launch` and by tests.

Stages, in order; each exists only once its module does:
  1. layout: split the devices into cells, build or load the model on the core cell;
  2. smoke generations: greedy decoding of `config.generate.prompts` with the KV cache;
  3. with `config.train.executions_dir`: SFT or RL steps on that execution store on all
     cells, checkpointing into `workdir/checkpoints` and resuming from it
     (`gyrejax.train.loop`); nothing else runs;
  otherwise (`gyrejax.stages`):
  4. warm start when `warmup.steps > 0`: demonstrations recorded through the harness,
     then SFT on them;
  5. RL for `train.steps` steps (`gyrejax.scheduler.runtime`): the harness runs groups
     of executions through JAX engines while the policy (`scheduler.policy`) moves cells
     between rollout and training; with `train.steps = 0`, one rollout batch instead
     (executions stored, mean reward reported).
Outputs in `workdir`: `layout.json`, `generations.jsonl`; stage 3 `metrics.jsonl`,
`checkpoints/`, `hf/step_<n>/`; stage 4 `demonstrations/`, `warmup/`; stage 5
`executions/`, `metrics.jsonl`, `transitions.jsonl`, `dispatch.jsonl`, `checkpoints/`,
`cell_roles.png`, `steps.png`, `run_summary.json` (or `rollout_summary.json`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import numpy as np
from absl import logging

from gyrejax import preflight
from gyrejax.cells import Cell, split_into_cells
from gyrejax.config import Config, ConfigError
from gyrejax.harness.sandbox import SandboxUnavailable, choose_sandbox
from gyrejax.model import sharding
from gyrejax.model.hf_io import load_hf
from gyrejax.model.sampling import generate
from gyrejax.model.transformer import Transformer, count_params, init_model
from gyrejax.scheduler.runtime import Runtime
from gyrejax.stages import rollout_batch, warm_start
from gyrejax.train.loop import train_on_store


def build_model(config: Config, cell: Cell) -> Transformer:
    """Loads `config.model.hf_checkpoint` or initialises randomly, placed on `cell`.

    Parameters are laid out with the rollout (sampling) rules: at this stage the model
    only generates.
    """
    rules = config.rollout.sharding_rules
    if config.model.hf_checkpoint:
        return load_hf(
            config.model.hf_checkpoint,
            mesh=cell.mesh,
            rules=rules,
            dtype=config.model.dtype,
            attention=config.model.attention,
            attention_block_size=config.model.attention_block_size,
        )
    model = init_model(config.model)
    sharding.shard_model(model, cell.mesh, rules)
    return model


def run(config: Config, workdir: str) -> dict:
    """Runs every stage that exists; returns a summary (also written to `workdir`).

    Raises:
      ConfigError: the config does not fit the run's inputs or devices (checked before
        anything is built or written).
    """
    preflight.check(config, len(jax.devices()))
    out = Path(workdir)
    out.mkdir(parents=True, exist_ok=True)
    if not config.train.executions_dir:  # agent code will run: harness.sandbox="bwrap"
        try:  # refuses to start without bubblewrap, before anything is built
            choose_sandbox(config.harness.sandbox)
        except SandboxUnavailable as e:  # "sandbox='bwrap': ..."
            raise ConfigError(f"config.harness.{e}") from e
    cells = split_into_cells(config.cells)
    core = cells[0]
    logging.info("devices: %d %s", len(jax.devices()), jax.devices()[0].platform)
    for cell in cells:
        logging.info("%s", cell.describe())

    start = time.perf_counter()
    model = build_model(config, core)
    params = count_params(model)
    logging.info(
        "model: %d layers, hidden %d, %d params (%s), built in %.1f s",
        model.config.num_layers,
        model.config.hidden_size,
        params,
        model.config.dtype,
        time.perf_counter() - start,
    )
    layout = {
        "platform": jax.devices()[0].platform,
        "num_devices": len(jax.devices()),
        "cells": [
            {"index": c.index, "devices": [d.id for d in c.devices], "mesh": dict(c.mesh.shape)}
            for c in cells
        ],
        "model": {"num_params": params, "num_layers": model.config.num_layers},
    }
    (out / "layout.json").write_text(json.dumps(layout, indent=2))

    start = time.perf_counter()
    with jax.set_mesh(core.mesh), sharding.axis_rules(config.rollout.sharding_rules):
        results = generate(
            model,
            [list(p) for p in config.generate.prompts],
            max_new_tokens=config.generate.max_new_tokens,
            temperature=0.0,
        )
    elapsed = time.perf_counter() - start
    with open(out / "generations.jsonl", "w") as f:
        for prompt, result in zip(config.generate.prompts, results, strict=True):
            record = {
                "prompt_ids": list(prompt),
                "token_ids": result.token_ids,
                "logprobs": result.logprobs,
                "finish_reason": result.finish_reason,
            }
            f.write(json.dumps(record) + "\n")
            logging.info(
                "greedy %s -> %s (mean logprob %.3f)",
                list(prompt),
                result.token_ids,
                float(np.mean(result.logprobs)),
            )
    logging.info("generated %d sequences in %.1f s", len(results), elapsed)
    summary = {"layout": layout, "generations": [r.token_ids for r in results]}

    if config.train.executions_dir:  # offline: train on a stored set, nothing else
        summary["train"] = train_on_store(config, cells, model, workdir).summary()
        return summary
    if config.warmup.steps:
        model = warm_start(config, cells, model, out)
    if config.train.steps:  # RL with the configured scheduling policy
        summary["rl"] = Runtime(config, cells, model, out).run()
    else:  # evaluation only: one batch of executions
        summary["rollout"] = rollout_batch(config, cells, model, out)
    return summary
