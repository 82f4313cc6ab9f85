"""What each boundary codec costs in `decentrl bench pipeline`: bytes and log-prob gap.

Per codec, through a 2-stage pipeline with no added RTT: the bytes one token's hidden state takes
(`bytes_per_token`) and those the proxy counted on the wire to the holder per position sent
(headers and the JSON step header included) and back per token; and the log-prob gap, per token
|log-prob the pipeline claims - the whole model's recomputation| (`benchmarks/engines.py`'s, the
trainer's code in float32), over rollouts of the demo's lease shape with EOS on, with the
tolerance they would calibrate (`trust/logprob_tolerance.py:calibrate`, a margin of 3) beside the
shipped entry `pipeline-<codec>/float32`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import PreTrainedModel

from benchmarks.engines import engine_gap
from benchmarks.pipeline.rig import Pipeline
from benchmarks.pipeline.workload import NO_EOS, demo_prompts
from decentrl.config import DEMO_CONFIG, load_config
from decentrl.envs.chat import ChatFormat
from decentrl.model.boundary_codec import CODECS, Codec, bytes_per_token
from decentrl.protocol import SamplingParams
from decentrl.stage_map import StageMap
from decentrl.trust.logprob_tolerance import CALIBRATED, calibrate

GAP_BATCH = 64  # the demo's lease: 8 groups of 8 samples


def codec_table(
    model_dir: Path,
    model: PreTrainedModel,
    state: dict[str, torch.Tensor],
    chat: ChatFormat,
    eos: list[int],
    pad: int,
    wire: tuple[list[list[int]], int],
    gap_rollouts: int,
) -> list[dict]:
    """One row per codec; `wire` is the (prompts, new tokens) of the bytes-on-the-wire pass."""
    config: Any = model.config
    stage_map = StageMap.even(config.num_hidden_layers, 2, config.tie_word_embeddings)
    rig = Pipeline(model_dir, stage_map, state, eos, pad)
    gap_prompts = demo_prompts(chat, gap_rollouts)
    rows = []
    try:
        for codec in CODECS:
            row = {"codec": codec, "bytes_per_token": bytes_per_token(codec, int(config.hidden_size))}
            row |= wire_bytes(rig, codec, *wire)
            row["gap"] = gap(rig, model, codec, eos, gap_prompts)
            shipped = CALIBRATED.get(f"pipeline-{codec}/float32")
            row["shipped_tolerance"] = None if shipped is None else shipped.model_dump()
            rows.append(row)
            tqdm.write(f"codec {codec}: {json.dumps(row)}", file=sys.stderr)
    finally:
        rig.close()
    return rows


def wire_bytes(rig: Pipeline, codec: Codec, prompts: list[list[int]], new_tokens: int) -> dict:
    rig.engine.eos_token_ids = NO_EOS
    rig.traffic()
    rig.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=new_tokens), 0, codec)
    (hop,) = rig.traffic()
    positions = len(prompts) * (max(len(p) for p in prompts) + new_tokens - 1)  # the prefill, then 1 a step
    return {
        "wire_bytes_per_position_to_holder": round(hop.bytes_up / positions, 1),
        "wire_bytes_per_token_from_last_holder": round(hop.bytes_down / (len(prompts) * new_tokens), 1),
    }


def gap(
    rig: Pipeline, model: PreTrainedModel, codec: Codec, eos: list[int], prompts: list[list[int]]
) -> dict:
    demo = load_config(DEMO_CONFIG, []).coordinator
    sampling = SamplingParams(temperature=demo.temperature, max_new_tokens=demo.max_new_tokens)
    rig.engine.eos_token_ids = eos
    errors: list[list[float]] = []
    for start in tqdm(range(0, len(prompts), GAP_BATCH), desc=f"gap {codec}", file=sys.stderr, leave=False):
        batch = prompts[start : start + GAP_BATCH]
        errors += engine_gap(model, batch, rig.generate(batch, sampling, 1000 + start, codec))[2]
    found = calibrate(errors)
    return {
        "rollouts": found["rollouts"],
        "tokens": found["tokens"],
        "mean": found["token_error_mean"],
        "p99": found["token_error_p99"],
        "max": found["token_error_max"],
        "calibrated_tolerance": found["tolerance"],
    }
